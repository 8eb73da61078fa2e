"""pagedmoe against transformers on tiny random checkpoints of every supported family."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint, spy_logits

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3"]


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_checkpoint(request.param, path, seed=FAMILIES.index(request.param))
    return request.param, path, hf


def _engine(path, **kw):
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine

    kw.setdefault("device", "cpu")
    kw.setdefault("dtype", "float32")
    return LLMEngine(EngineConfig(model=str(path), **kw))


def test_prefill_and_decode_logits_match(checkpoint):
    """Logits of the prefill and of every decode step, max abs diff <= 1e-4 (float32)."""
    from pagedmoe.engine.request import Request
    from pagedmoe.sampling_params import SamplingParams

    family, path, hf = checkpoint
    engine = _engine(path, max_model_len=128)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 384, (13,), generator=gen).tolist()
    steps = 6
    # Reference: transformers' full forward on the growing sequence, greedy.
    tokens = list(prompt)
    ref_logits = []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            ref_logits.append(logits)
            tokens.append(int(logits.argmax()))
    # Engine: capture the logits it samples from.
    captured = spy_logits(engine)
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                       prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(captured) == steps
    for i, (ours, ref) in enumerate(zip(captured, ref_logits)):
        diff = (ours[0] - ref).abs().max().item()
        assert diff <= 1e-4, f"{family} step {i}: max abs diff {diff}"
