"""FP8 block-scaled checkpoints (DeepSeek-V3 layout) are dequantised on load, exactly."""
from __future__ import annotations

import shutil

import pytest
import torch

from tiny_models import make_tiny_checkpoint, spy_logits, write_fp8_checkpoint


def _trace(path, **kw):
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, **kw)
    captured = spy_logits(llm.engine)
    prompts = [list(range(3, 20)), [7, 100, 200, 5]]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    return captured, llm.engine


@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
def test_fp8_checkpoint_equals_its_dequantised_weights(tmp_path, block):
    from safetensors.torch import save_file

    hf = make_tiny_checkpoint("deepseek_v3", tmp_path / "bf", seed=4)
    ref_state = write_fp8_checkpoint(hf, tmp_path / "bf", tmp_path / "fp8", block)
    # The same weights, dequantised by the test, as a plain float32 checkpoint.
    plain = tmp_path / "plain"
    shutil.copytree(tmp_path / "bf", plain)
    for f in plain.glob("model*"):
        f.unlink()
    save_file({n: t.contiguous() for n, t in ref_state.items()}, str(plain / "model.safetensors"))

    got, engine = _trace(tmp_path / "fp8", num_gpu_experts=3)  # paged: the dequantised experts stream too
    ref, _ = _trace(plain, num_gpu_experts=3)
    assert len(got) == len(ref) > 0
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
    params = dict(engine.model.named_parameters())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(params[name], ref_state[name])
    assert not torch.equal(ref_state[name], hf.state_dict()[name])  # fp8 really rounded it
    # ... and stays near the unquantised model (e4m3 keeps 3 mantissa bits: a few % per weight).
    full, _ = _trace(tmp_path / "bf", num_gpu_experts=3)
    cos = torch.nn.functional.cosine_similarity(got[0].flatten(), full[0].flatten(), dim=0).item()
    assert cos > 0.95


def test_fp8_unpaired_scale_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    hf = make_tiny_checkpoint("deepseek_v3", tmp_path / "bf", seed=4)
    write_fp8_checkpoint(hf, tmp_path / "bf", tmp_path / "fp8", (16, 16))
    shard = tmp_path / "fp8" / "model-00002-of-00002.safetensors"
    scales = load_file(str(shard))
    scales.pop("model.layers.0.self_attn.o_proj.weight_scale_inv")
    save_file(scales, str(shard))
    with pytest.raises(CheckpointError, match="o_proj.weight"):
        LLM(str(tmp_path / "fp8"), device="cpu", dtype="float32", max_model_len=64)
