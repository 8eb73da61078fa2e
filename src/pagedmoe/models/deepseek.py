"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM) and DeepSeek-V3 / R1 (DeepseekV3ForCausalLM).

What they share with GLM-4.5 (moe_decoder.py's generic ArchSpec switches, layers/moe.py):
- `mlp.shared_experts` (n_shared_experts * moe_intermediate_size, ungated) and `mlp.experts.*` routed
  experts that go through the expert store like every family's (so they page);
- the first `first_k_dense_replace` layers use a dense MLP of intermediate_size;
- V3: the "sigmoid_grouped" router (e_score_correction_bias, group-limited top-k, norm_topk_prob,
  routed_scaling_factor) and trailing MTP layers (num_nextn_predict_layers) that are skipped.
- V2: the "softmax_grouped" router: float32 gate, softmax, topk_method "greedy" or
  "group_limited_greedy" (n_group / topk_group), routed_scaling_factor; norm_topk_prob renormalises
  (transformers' V2 router ignores it; every released V2 config has it False).
What is theirs: multi-head latent attention (layers/mla.py) with the compressed latent in the paged
cache, and rope on qk_rope_head_dim dims: YaRN (attention factor on cos/sin, mscale_all_dim ** 2 on
the softmax scale) and the interleaved-pair layout (V2 always; V3 when rope_interleave).
FP8 block-scaled checkpoints (V3's quantization_config) are dequantised on load (models/fp8.py).
"""
from __future__ import annotations

from pagedmoe.models.layers.mla import MLADims
from pagedmoe.models.layers.rotary import rope_parameters_of, yarn_get_mscale
from pagedmoe.models.moe_decoder import ArchSpec, ModelDims


def mla_dims_of(c) -> MLADims:
    rope = rope_parameters_of(c)
    scale = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** -0.5
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        mscale = yarn_get_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * mscale * mscale
    return MLADims(q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                   qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                   attention_bias=bool(getattr(c, "attention_bias", False)), scale=scale)


def _dims(c, interleaved: bool) -> ModelDims:
    mla = mla_dims_of(c)
    rope = rope_parameters_of(c)
    return ModelDims(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_layers=c.num_hidden_layers,
        num_heads=c.num_attention_heads, num_kv_heads=1, head_dim=mla.cache_head_dim,
        num_experts=c.n_routed_experts, top_k=c.num_experts_per_tok, moe_intermediate_size=c.moe_intermediate_size,
        dense_intermediate_size=c.intermediate_size, rms_norm_eps=c.rms_norm_eps, rope_theta=rope["rope_theta"],
        max_position=c.max_position_embeddings, tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        mla=mla, rope_parameters=rope, rope_interleaved=interleaved,
    )


def _num_mtp_layers(c) -> int:
    num_mtp = getattr(c, "num_nextn_predict_layers", None)
    if num_mtp is None:
        num_mtp = getattr(c, "num_mtp_layers", 0)
    return int(num_mtp or 0)


def _common_spec(c) -> dict:
    freq = getattr(c, "moe_layer_freq", 1) or 1
    if freq != 1:  # transformers ignores it too; every released DeepSeek config has 1
        raise NotImplementedError(f"moe_layer_freq {freq} is not supported (only 1: every layer after "
                                  f"first_k_dense_replace is MoE)")
    return dict(
        moe_prefix="mlp", expert_names=("gate_proj", "up_proj", "down_proj"),
        renormalize=bool(getattr(c, "norm_topk_prob", False)),
        shared_intermediate_size=c.moe_intermediate_size * (getattr(c, "n_shared_experts", 0) or 0),
        shared_expert_gate=False, shared_expert_name="shared_experts",
        dense_layers=frozenset(range(min(c.first_k_dense_replace or 0, c.num_hidden_layers))),
        routed_scaling_factor=float(c.routed_scaling_factor),
    )


def build_spec_v2(c) -> tuple[ModelDims, ArchSpec]:
    method = getattr(c, "topk_method", "greedy") or "greedy"
    if method not in ("greedy", "group_limited_greedy"):
        raise NotImplementedError(f"DeepSeek-V2 topk_method {method!r} is not supported "
                                  f"(only 'greedy', 'group_limited_greedy')")
    grouped = method == "group_limited_greedy"
    spec = ArchSpec(router="softmax_grouped", n_group=(c.n_group or 1) if grouped else 1,
                    topk_group=(c.topk_group or 1) if grouped else 1, **_common_spec(c))
    return _dims(c, interleaved=True), spec


def build_spec_v3(c) -> tuple[ModelDims, ArchSpec]:
    spec = ArchSpec(router="sigmoid_grouped", n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                    num_mtp_layers=_num_mtp_layers(c), **_common_spec(c))
    return _dims(c, interleaved=bool(getattr(c, "rope_interleave", True))), spec
