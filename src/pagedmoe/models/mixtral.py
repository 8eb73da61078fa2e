"""Mixtral (MixtralForCausalLM): softmax top-k router with renormalisation, experts w1/w3/w2."""
from __future__ import annotations

from pagedmoe.models.moe_decoder import ArchSpec, ModelDims


def build_spec(c) -> tuple[ModelDims, ArchSpec]:
    dims = ModelDims.from_hf(c, num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size)
    spec = ArchSpec(moe_prefix="block_sparse_moe", expert_names=("w1", "w3", "w2"), renormalize=True)
    return dims, spec
