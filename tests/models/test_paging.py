"""Expert paging changes where expert bytes live, never what the model computes."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_checkpoint(request.param, path, seed=30 + FAMILIES.index(request.param))
    return path


def _logits_trace(path, device="cpu", **flags):
    """Logits of every sampling step for a small batch, plus the engine."""
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(path), device=device, max_model_len=96, **flags)
    captured = []
    orig = llm.engine.sampler.sample
    llm.engine.sampler.sample = lambda logits, *a: captured.append(logits.detach().cpu().clone()) or orig(logits, *a)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (7, 19, 3, 30)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return captured, llm.engine


@pytest.mark.parametrize("flags", [dict(cpu_moe=True), dict(num_gpu_experts=3), dict(num_gpu_experts=7),
                                   dict(expert_placement="paged", num_gpu_experts=8)])
def test_paged_logits_bit_identical_to_resident(ckpt, flags):
    ref, _ = _logits_trace(ckpt)
    got, engine = _logits_trace(ckpt, **flags)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    stats = engine.get_stats()
    n_res = flags.get("num_gpu_experts", 0)
    num_moe = len(engine.model.moe_layers())
    assert stats["experts"].get("resident/bf16", 0) == n_res * num_moe
    assert stats["experts"].get("host/bf16", 0) == (8 - n_res) * num_moe
    # Every forward streams every host-tier expert of every layer.
    per_forward = engine.pager.bytes_per_forward
    assert per_forward == (8 - n_res) * num_moe * engine.expert_store.expert_numel * 4  # float32
    assert stats["expert_bytes_h2d"] == per_forward * engine.num_steps


def test_paged_under_preemption_matches_resident(ckpt):
    from pagedmoe import LLM, SamplingParams

    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (20, 28, 12, 33, 9, 25)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = {}
    for name, flags in (("resident", {}), ("paged", dict(num_gpu_experts=2))):
        llm = LLM(str(ckpt), device="cpu", max_model_len=48, block_size=8, num_kv_blocks=8, **flags)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[name] = [o.outputs[0].token_ids for o in res]
        assert llm.engine.scheduler.num_preemptions_total > 0
    assert outs["resident"] == outs["paged"]


def test_placement_flags_that_cannot_take_effect(ckpt):
    from pagedmoe import LLM

    with pytest.raises(ValueError, match="cannot take effect"):
        LLM(str(ckpt), device="cpu", expert_placement="resident", cpu_moe=True)
    with pytest.raises(ValueError, match="exceeds the model's 8 experts"):
        LLM(str(ckpt), device="cpu", num_gpu_experts=9)
    with pytest.raises(ValueError, match="contradicts"):
        LLM(str(ckpt), device="cpu", expert_placement="paged", cpu_moe=True, num_gpu_experts=2)
    with pytest.raises(ValueError, match="vmm"):
        LLM(str(ckpt), device="cpu", cpu_moe=True, expert_placement="paged", expert_buffers="vmm")


def test_paging_frees_device_memory_for_kv(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=6)
    probe = LLM(str(tmp_path), device="cpu", max_model_len=64).engine.plan
    # A budget that leaves the resident placement 20 KV blocks.
    budget = (probe.weight_bytes + probe.activation_bytes + 20 * probe.kv_bytes_per_block + 100) / 1024 ** 3
    resident = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=budget,
                   expert_placement="resident").engine
    assert resident.plan.num_kv_blocks == 20
    paged = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=budget, cpu_moe=True).engine
    # Two layers' buffers instead of all six layers' experts: the difference goes to KV blocks.
    freed = resident.expert_store.device_bytes - paged.expert_store.device_bytes
    assert freed == 4 * paged.expert_store.row_bytes * 8
    assert paged.plan.num_kv_blocks - resident.plan.num_kv_blocks == freed // paged.plan.kv_bytes_per_block


def test_auto_placement_follows_the_planner(tmp_path):
    from pagedmoe import LLM

    make_tiny_checkpoint("mixtral", tmp_path, seed=1, num_hidden_layers=6)
    big = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=8).engine
    assert not big.expert_store.paged  # everything fits: resident wins
    probe = big.plan
    tight = (probe.weight_bytes + probe.activation_bytes + 8 * probe.kv_bytes_per_block) / 1024 ** 3
    small = LLM(str(tmp_path), device="cpu", max_model_len=64, gpu_memory_gb=tight).engine
    plan = small.placement_plan
    assert plan is not None and small.expert_store.paged == (plan.mode != "resident")
    assert small.expert_store.table.count(0, "resident") == plan.placement.num_gpu_experts[0]
