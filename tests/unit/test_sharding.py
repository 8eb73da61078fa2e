"""parallel/sharding.py: the rank's shapes and checkpoint slices (the 2-rank runs are in
tests/models/test_tensor_parallel.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedmoe.models.hf_config import load_hf_config
from pagedmoe.models.registry import spec_builder
from pagedmoe.parallel.sharding import shard_arch, shard_tensor

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks" / "configs"


def test_slices_by_rank_and_replicates_kv_heads():
    w = torch.arange(8 * 3).view(8, 3)
    assert torch.equal(shard_tensor(w, (4, 3), 1, 2), w[4:])              # column-parallel: rank 1's half
    assert torch.equal(shard_tensor(w.t(), (3, 4), 0, 2), w.t()[:, :4])   # row-parallel
    # 2 KV heads of 4 rows over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    assert [shard_tensor(w, (4, 3), r, 4)[0, 0].item() for r in range(4)] == [0, 0, 12, 12]
    assert shard_tensor(w, (8, 3), 1, 2) is w                             # replicated


def test_full_size_splits_by_hand():
    glm = load_hf_config(str(CONFIGS / "glm-4.5"))
    dims, spec = spec_builder(glm)(glm)
    d8, s8 = shard_arch(dims, spec, 8, expert_parallel=True)
    assert (d8.num_heads, d8.num_kv_heads, d8.num_experts) == (96 // 8, 1, 160 // 8)
    assert d8.moe_intermediate_size == dims.moe_intermediate_size          # whole experts under EP
    assert s8.shared_intermediate_size == spec.shared_intermediate_size // 8
    mix = load_hf_config(str(CONFIGS / "mixtral-8x7b"))
    d2, _ = shard_arch(*spec_builder(mix)(mix), 2)
    assert (d2.num_heads, d2.num_kv_heads, d2.num_experts, d2.moe_intermediate_size) == (16, 4, 8, 7168)
    with pytest.raises(ValueError, match="multiple of 16 experts"):
        shard_arch(*spec_builder(mix)(mix), 16, expert_parallel=True)
    v3 = load_hf_config(str(CONFIGS / "deepseek-v3"))
    dims3, _ = spec_builder(v3)(v3)
    d3, _ = shard_arch(*spec_builder(v3)(v3), 8, expert_parallel=True)  # MLA: heads split, the latent whole
    assert (d3.num_heads, d3.num_experts, d3.mla) == (128 // 8, 256 // 8, dims3.mla)
    assert (d3.num_kv_heads, d3.head_dim) == (dims3.num_kv_heads, dims3.head_dim)  # the latent cache pair
    v3.attention_bias = True
    with pytest.raises(ValueError, match="multi-head latent attention with biases"):
        shard_arch(*spec_builder(v3)(v3), 8)
