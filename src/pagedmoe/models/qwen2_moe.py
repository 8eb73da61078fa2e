"""Qwen2-MoE (Qwen2MoeForCausalLM): q/k/v bias, shared expert behind a sigmoid gate."""
from __future__ import annotations

from pagedmoe.models.moe_decoder import ArchSpec, ModelDims
from pagedmoe.models.qwen3_moe import dense_layers


def build_spec(c) -> tuple[ModelDims, ArchSpec]:
    dims = ModelDims.from_hf(c, num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size)
    spec = ArchSpec(
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(c.norm_topk_prob), qkv_bias=bool(getattr(c, "qkv_bias", True)),
        shared_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gate=True,
        dense_layers=dense_layers(c),
    )
    return dims, spec
