"""Expert paging on the GPU: copy stream + events, plain and VMM buffers, with and without CUDA graphs."""
from __future__ import annotations

import pytest
import torch

from tiny_models import greedy_logits, make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=40, num_hidden_layers=4)
    return path


def _trace(path, **flags):
    from pagedmoe import LLM

    llm = LLM(str(path), device="cuda", dtype="bfloat16", max_model_len=128, max_num_seqs=8, **flags)
    captured, outs = greedy_logits(llm, (7, 19, 3, 30, 11), max_tokens=8, seed=5)
    return captured, [o.outputs[0].token_ids for o in outs], llm.engine


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("flags", [dict(cpu_moe=True, expert_buffers="plain"),
                                   dict(num_gpu_experts=3, expert_buffers="plain"),
                                   dict(cpu_moe=True, expert_buffers="vmm"),
                                   dict(num_gpu_experts=5, expert_buffers="vmm"),
                                   dict(cpu_moe=True, expert_buffers="vmm-ring"),
                                   dict(num_gpu_experts=5, expert_buffers="vmm-ring"),
                                   dict(cpu_moe=True, expert_buffers="vmm", host_compression="lossless"),
                                   dict(num_gpu_experts=3, expert_buffers="vmm-ring", host_compression="lossless")])
def test_paged_matches_resident_on_gpu(ckpt, flags, eager):
    ref_logits, ref_tokens, ref_engine = _trace(ckpt, enforce_eager=eager, expert_buffers="plain")
    logits, tokens, engine = _trace(ckpt, enforce_eager=eager, **flags)
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        assert torch.equal(a, b)
    stats = engine.get_stats()
    assert stats["expert_bytes_h2d"] == engine.pager.bytes_per_forward * engine.num_steps
    if eager:
        assert stats["expert_copy_s"] > 0
    store = engine.expert_store
    host = [t for t in store.host if t is not None and t.numel()]
    host += [ct.raw for cts in store.host_compressed if cts for ct in cts]  # --host-compression lossless
    assert host and all(t.is_pinned() for t in host)  # registered pages: asynchronous copies
    if flags.get("expert_buffers") in ("vmm", "vmm-ring"):
        assert stats["expert_bytes_d2d"] == 0  # resident experts are mapped, never copied


@pytest.mark.parametrize("eager", [True, False])
@pytest.mark.parametrize("counts", [[5, 3, 8, 2], [8, 8, 6, 3]])
def test_ring_buffers_with_uneven_layers(ckpt, counts, eager, monkeypatch):
    """vmm-ring with a different number of resident experts per layer (the planner's spread placements):
    copies issued at the forward's start and after the MoE of the layer whose ring rows they reuse; logits
    identical to resident placement, with and without CUDA graphs."""
    from pagedmoe.engine import startup
    from pagedmoe.planning.cost_model import ring_wait_layers
    from pagedmoe.planning.resolve import ExpertPlan

    ref_logits, ref_tokens, _ = _trace(ckpt, enforce_eager=eager, expert_buffers="plain")
    monkeypatch.setattr(startup, "resolve_expert_plan", lambda *a, **kw: ExpertPlan("paged", tuple(counts), None))
    logits, tokens, engine = _trace(ckpt, enforce_eager=eager, expert_buffers="vmm-ring")
    buffers = engine.expert_store.buffers
    assert buffers.ring and engine.pager.ring
    assert engine.pager._wait_layer == ring_wait_layers(buffers.streamed_rows, buffers.ring_size)
    assert tokens == ref_tokens
    for a, b in zip(ref_logits, logits):
        assert torch.equal(a, b)
