"""The expert interface a MoE layer calls (experts/interface.py), and the one resolver from flags to a frozen
ExpertPlan (planning/resolve.py), on CPU."""
import dataclasses

import pytest
import torch

from pagedmoe.config import EngineConfig, default_model_path
from pagedmoe.experts.interface import DenseOperand
from pagedmoe.models.hf_config import load_hf_config
from pagedmoe.models.layers.moe import FusedMoE, experts_loop
from pagedmoe.models.registry import spec_builder
from pagedmoe.planning.resolve import ExpertPlan, planning_buffer_kind, resolve_expert_plan


class SpyExperts:
    """An experts object that hands out fixed dense weights and records what the layer passes it."""

    def __init__(self, w13, w2):
        self.w13, self.w2, self.calls = w13, w2, []

    def begin_forward(self, num_tokens=None):
        self.calls.append(("begin", num_tokens))

    def before_layer(self, layer):
        self.calls.append(("before", layer))

    def weights(self, layer, topk_ids, counted=False):
        assert not counted   # no activity table here: the layer counts nothing itself
        self.calls.append(("weights", layer, topk_ids))
        return DenseOperand(self.w13, self.w2)

    def done(self, layer):
        self.calls.append(("done", layer))


def test_moe_layer_passes_its_router_ids_and_says_when_done():
    torch.manual_seed(0)
    H, I, E, A, T = 32, 16, 8, 2, 5
    w13, w2 = torch.randn(E, 2 * I, H) * 0.1, torch.randn(E, H, I) * 0.1
    spy = SpyExperts(w13, w2)
    moe = FusedMoE(H, I, E, A, renormalize=True, moe_idx=3, experts=spy)
    moe.gate.weight.data.normal_(0.0, 0.5)
    moe.experts_fn = experts_loop
    x = torch.randn(T, H)
    out = moe(x)
    weights, ids = moe.route(x)
    assert [c[0] for c in spy.calls] == ["weights", "done"]
    _, layer, seen_ids = spy.calls[0]
    assert layer == 3 and spy.calls[1] == ("done", 3)
    # the router's ids as a device tensor (no host copy), exactly the top-k the GEMMs use
    assert isinstance(seen_ids, torch.Tensor) and seen_ids.shape == (T, A) and torch.equal(seen_ids, ids)
    assert torch.equal(out, experts_loop(x, w13, w2, weights, ids))


def test_moe_layer_without_experts_says_so():
    moe = FusedMoE(32, 16, 8, 2, renormalize=True, moe_idx=0)
    with pytest.raises(RuntimeError, match="built without experts"):
        moe(torch.randn(3, 32))


def _dims():
    hf = load_hf_config(default_model_path())
    return spec_builder(hf)(hf)


def _resolve(**flags):
    dims, spec = _dims()
    return resolve_expert_plan(EngineConfig(device="cpu", **flags), dims, spec, device_type="cpu",
                               dtype=torch.float32, max_model_len=64, budget=lambda: None,
                               host_budget=lambda: None)


def test_resolver_turns_flags_into_one_frozen_plan():
    dims, spec = _dims()
    num_moe = dims.num_layers - len(spec.dense_layers)
    assert _resolve().mode == "resident"                       # CPU without a budget: nothing to trade
    fixed = _resolve(num_gpu_experts=2)
    assert (fixed.mode, fixed.num_gpu_experts, fixed.num_compressed) == ("paged", (2,) * num_moe, (0,) * num_moe)
    assert _resolve(cpu_moe=True).num_gpu_experts == (0,) * num_moe
    assert _resolve(expert_placement="paged").num_gpu_experts == (0,) * num_moe
    with pytest.raises(dataclasses.FrozenInstanceError):
        fixed.mode = "resident"
    with pytest.raises(ValueError, match="exceeds the model's"):
        _resolve(num_gpu_experts=dims.num_experts + 1)


def test_one_buffer_kind_for_engine_and_plan():
    # pagedmoe plan models a GPU; the engine off CUDA always gets the plain double buffer
    assert [planning_buffer_kind(b, True) for b in ("auto", "vmm", "vmm-ring", "plain")] == \
        ["vmm", "vmm", "vmm-ring", "plain"]
    assert {planning_buffer_kind(b, False) for b in ("auto", "vmm", "vmm-ring", "plain")} == {"plain"}
    assert ExpertPlan("paged", (1, 2)).paged and not ExpertPlan("resident").paged


def test_config_nests_every_flag_in_one_section():
    from pagedmoe.config_sections import SECTIONS

    flat = [f.name for f in dataclasses.fields(EngineConfig)]
    nested = [name for _, names in SECTIONS.values() for name in names]
    assert sorted(flat) == sorted(nested)                      # each flag in exactly one section
    c = EngineConfig(device="cpu", cpu_moe=True, block_size=32, max_num_seqs=4)
    assert (c.experts.cpu_moe, c.cache.block_size, c.scheduler.max_num_seqs, c.model_config.device) == \
        (True, 32, 4, "cpu")
    assert c.experts.placement_mode() == c.placement() == ("paged", 0)
    with pytest.raises(ValueError, match="contradicts --num-gpu-experts"):   # the rules run on construction
        EngineConfig(cpu_moe=True, num_gpu_experts=2)
