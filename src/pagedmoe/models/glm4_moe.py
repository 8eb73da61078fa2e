"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM).

Differences from the Qwen families, all generic ArchSpec switches (moe_decoder.py):
- router "sigmoid_grouped": sigmoid scores + `mlp.gate.e_score_correction_bias`, group-limited
  top-k (n_group / topk_group), norm_topk_prob, routed_scaling_factor (layers/moe.py);
- `mlp.shared_experts`: a plain SwiGLU of n_shared_experts * moe_intermediate_size, added ungated;
- the first `first_k_dense_replace` layers use a dense MLP of intermediate_size;
- partial rotary (rope_parameters.partial_rotary_factor, half-split layout), q/k/v bias when
  attention_bias, per-head q/k RMSNorm when use_qk_norm;
- the checkpoint's trailing MTP layer(s) (num_nextn_predict_layers) are skipped.
DeepSeek-V2/V3 (deepseek.py) reuse the router, shared experts and dense layers, with MLA attention.
"""
from __future__ import annotations

import dataclasses

from pagedmoe.models.layers.rotary import partial_rotary_factor_of
from pagedmoe.models.moe_decoder import ArchSpec, ModelDims


def build_spec(c) -> tuple[ModelDims, ArchSpec]:
    num_experts = c.n_routed_experts
    dims = ModelDims.from_hf(c, num_experts=num_experts, moe_intermediate_size=c.moe_intermediate_size)
    dims = dataclasses.replace(dims, rotary_dim=int(dims.head_dim * partial_rotary_factor_of(c)))
    num_mtp = getattr(c, "num_nextn_predict_layers", None)
    if num_mtp is None:
        num_mtp = getattr(c, "num_mtp_layers", 0)
    spec = ArchSpec(
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(c.norm_topk_prob), qkv_bias=bool(getattr(c, "attention_bias", False)),
        qk_norm="head" if getattr(c, "use_qk_norm", False) else None,
        shared_intermediate_size=c.moe_intermediate_size * (getattr(c, "n_shared_experts", 0) or 0),
        shared_expert_gate=False, shared_expert_name="shared_experts",
        dense_layers=frozenset(range(min(c.first_k_dense_replace, c.num_hidden_layers))),
        router="sigmoid_grouped", n_group=c.n_group or 1, topk_group=c.topk_group or 1,
        routed_scaling_factor=float(c.routed_scaling_factor), num_mtp_layers=int(num_mtp or 0),
    )
    return dims, spec
