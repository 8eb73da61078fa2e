"""GLM-4.5 pieces against transformers' own modules: the grouped sigmoid router (which DeepSeek-V3
shares), partial rotary, the float32 router under a bf16 model, skipped MTP layers."""
from __future__ import annotations

import pytest
import torch


def _glm_config(**kw):
    import transformers

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=16,
                num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64)
    return transformers.Glm4MoeConfig(**dict(base, **kw))


@pytest.mark.parametrize("n_group,topk_group,norm,scale", [(1, 1, True, 1.0), (4, 2, True, 2.5),
                                                           (8, 3, False, 1.5), (2, 1, True, 1.0)])
def test_router_matches_transformers(n_group, topk_group, norm, scale):
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from pagedmoe.models.layers.moe import route_sigmoid_grouped

    cfg = _glm_config(n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=scale)
    gen = torch.Generator().manual_seed(n_group)
    ref = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 32, generator=gen))
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.5)
    x = torch.randn(37, 32, generator=gen)
    logits, ref_w, ref_ids = ref(x)
    w, ids = route_sigmoid_grouped(x @ ref.weight.T, ref.e_score_correction_bias, 4, n_group, topk_group,
                                   norm, scale)
    # topk(sorted=False) orders ids arbitrarily: compare per token as sorted (id, weight) pairs.
    ref_order, order = ref_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if n_group > 1:  # the group limit changes choices here, so the test would see a wrong mask
        ungrouped = route_sigmoid_grouped(logits, ref.e_score_correction_bias, 4, 1, 1, norm, scale)[1]
        assert not torch.equal(ungrouped.sort(dim=-1)[0], ids.sort(dim=-1)[0])


def test_partial_rotary_matches_transformers():
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding, apply_rotary_pos_emb

    from pagedmoe.models.layers.rotary import RotaryEmbedding, partial_rotary_factor_of

    cfg = _glm_config(partial_rotary_factor=0.5)
    assert partial_rotary_factor_of(cfg) == 0.5
    rot = RotaryEmbedding(16, 64, 10000.0, rotary_dim=8)
    rot.build(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    positions = torch.tensor([0, 1, 2, 5, 17, 33, 40, 62, 63])
    cos, sin = Glm4MoeRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rot(positions, q, k)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., 8:], q[..., 8:])  # the second half of each head passes through


def test_spec_router_fp32_and_mtp_layers_skipped():
    import dataclasses

    from pagedmoe.models.glm4_moe import build_spec
    from pagedmoe.models.moe_decoder import MoEForCausalLM

    cfg = _glm_config(n_group=4, topk_group=2, routed_scaling_factor=2.5, num_nextn_predict_layers=1)
    dims, spec = build_spec(cfg)
    assert (dims.rotary_dim, spec.dense_layers, spec.num_mtp_layers) == (8, frozenset({0}), 1)
    assert (spec.shared_intermediate_size, spec.shared_expert_gate, spec.router) == (16, False, "sigmoid_grouped")
    model = MoEForCausalLM(cfg, dims, spec, 64).to(torch.bfloat16)
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.shared_experts.gate_proj.weight.dtype == torch.bfloat16
    params = dict(model.named_parameters())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in params
    assert model.load_tensor("model.layers.2.mlp.experts.0.gate_proj.weight", torch.zeros(16, 32), params) == []
    assert model.load_tensor("model.layers.2.eh_proj.weight", torch.zeros(32, 64), params) == []
    with pytest.raises(KeyError):  # past the MTP layers: still an error
        model.load_tensor("model.layers.3.input_layernorm.weight", torch.zeros(32), params)
    no_mtp = MoEForCausalLM(cfg, dims, dataclasses.replace(spec, num_mtp_layers=0), 64)
    with pytest.raises(KeyError):
        no_mtp.load_tensor("model.layers.2.eh_proj.weight", torch.zeros(32, 64), params)
