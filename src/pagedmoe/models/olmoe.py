"""OLMoE (OlmoeForCausalLM): q/k RMSNorm over the whole projection, optional qkv clipping."""
from __future__ import annotations

from pagedmoe.models.moe_decoder import ArchSpec, ModelDims


def build_spec(c) -> tuple[ModelDims, ArchSpec]:
    dims = ModelDims.from_hf(c, num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size)
    spec = ArchSpec(
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(getattr(c, "norm_topk_prob", False)),
        qkv_bias=bool(getattr(c, "attention_bias", False)), qk_norm="full",
        clip_qkv=getattr(c, "clip_qkv", None),
    )
    return dims, spec
