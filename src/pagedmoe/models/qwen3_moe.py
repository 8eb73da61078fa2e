"""Qwen3-MoE (Qwen3MoeForCausalLM): per-head q/k RMSNorm, no shared expert."""
from __future__ import annotations

from pagedmoe.models.moe_decoder import ArchSpec, ModelDims


def dense_layers(c) -> frozenset:
    """Qwen layers that use a dense MLP: listed in mlp_only_layers or off the decoder_sparse_step."""
    step = getattr(c, "decoder_sparse_step", 1) or 1
    only = set(getattr(c, "mlp_only_layers", None) or [])
    return frozenset(i for i in range(c.num_hidden_layers)
                     if i in only or c.num_experts == 0 or (i + 1) % step != 0)


def build_spec(c) -> tuple[ModelDims, ArchSpec]:
    dims = ModelDims.from_hf(c, num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size)
    spec = ArchSpec(
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(c.norm_topk_prob), qkv_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm="head", dense_layers=dense_layers(c),
    )
    return dims, spec
