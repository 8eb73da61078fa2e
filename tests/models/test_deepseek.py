"""DeepSeek-V2/V3 pieces against transformers' own modules: YaRN + interleaved rope, the V2 softmax
group-limited router, MLA's compressed latent in the paged cache and its sizing."""
from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_checkpoint, spy_logits, tiny_hf_config


@pytest.mark.parametrize("interleave", [True, False])
def test_v3_rope_matches_transformers(interleave):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ref

    from pagedmoe.models.deepseek import build_spec_v3
    from pagedmoe.models.moe_decoder import DecoderModel

    cfg = tiny_hf_config("deepseek_v3", rope_interleave=interleave)
    dims, spec = build_spec_v3(cfg)
    rot = DecoderModel(dims, spec, 256).rotary
    rot.build(torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(9, 4, 8, generator=gen), torch.randn(9, 1, 8, generator=gen)
    positions = torch.tensor([0, 1, 2, 5, 17, 33, 63, 64, 200])
    cos, sin = ref.DeepseekV3RotaryEmbedding(cfg)(q, positions[None])
    apply = ref.apply_rotary_pos_emb_interleave if interleave else ref.apply_rotary_pos_emb
    ref_q, ref_k = apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = rot(positions, q, k)
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # YaRN is on: the attention factor scales cos/sin, and the softmax scale carries mscale^2.
    assert abs(rot.cos_sin[0, 0, 0].item() - 1.0) > 1e-3
    assert dims.mla.scale == pytest.approx(ref.DeepseekV3Attention(cfg, 0).scaling, rel=1e-7)


def test_v2_complex_rope_gives_the_same_scores():
    """V2 rotates pairs as complex numbers and keeps them interleaved; ours writes them half-split.
    The same permutation applies to q and k, so every q.k (what attention sees) is equal."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as ref

    from pagedmoe.models.deepseek import build_spec_v2
    from pagedmoe.models.moe_decoder import DecoderModel

    cfg = tiny_hf_config("deepseek_v2")
    dims, spec = build_spec_v2(cfg)
    rot = DecoderModel(dims, spec, 256).rotary
    rot.build(torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(7, 4, 8, generator=gen), torch.randn(7, 1, 8, generator=gen)
    positions = torch.tensor([0, 3, 9, 31, 64, 100, 255])
    freqs = ref.DeepseekV2RotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = ref.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], freqs)
    got_q, got_k = rot(positions, q, k)
    ref_scores = torch.einsum("hqd,hkd->hqk", ref_q[0], ref_k[0].expand(4, -1, -1))
    got_scores = torch.einsum("qhd,khd->hqk", got_q, got_k.expand(-1, 4, -1))
    torch.testing.assert_close(got_scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert dims.mla.scale == pytest.approx(ref.DeepseekV2Attention(cfg, 0).scaling, rel=1e-7)


@pytest.mark.parametrize("method,n_group,topk_group,scale", [("greedy", 1, 1, 1.0),
                                                            ("group_limited_greedy", 4, 2, 1.5),
                                                            ("group_limited_greedy", 8, 3, 16.0)])
def test_v2_router_matches_transformers(method, n_group, topk_group, scale):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from pagedmoe.models.layers.moe import route_softmax_grouped

    cfg = tiny_hf_config("deepseek_v2", n_routed_experts=16, num_experts_per_tok=4, topk_method=method,
                         n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
    gen = torch.Generator().manual_seed(n_group)
    ref = DeepseekV2TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(16, 64, generator=gen))
    x = torch.randn(41, 64, generator=gen)
    logits, ref_w, ref_ids = ref(x)
    w, ids = route_softmax_grouped(logits, 4, n_group, topk_group, False, scale)
    ref_order, order = ref_ids.argsort(dim=-1), ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-6, atol=1e-7)
    if n_group > 1:  # the group limit changes choices here
        ungrouped = route_softmax_grouped(logits, 4, 1, 1, False, scale)[1]
        assert not torch.equal(ungrouped.sort(dim=-1)[0], ids.sort(dim=-1)[0])


@pytest.mark.parametrize("kv_lora_rank", [24, 23])  # even and odd latent sizes (odd: one pad value)
def test_cache_holds_the_compressed_latent(tmp_path, kv_lora_rank):
    """The paged cache holds kv_a_layernorm(c) ++ roped k_pe per token, nothing expanded; the engine,
    the model runner and the planner agree on its size."""
    from pagedmoe import LLM, SamplingParams
    from pagedmoe.planning.model_shape import ModelShape

    hf = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=3, kv_lora_rank=kv_lora_rank)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, block_size=8)
    engine = llm.engine
    latent = kv_lora_rank + 8
    D = -(-latent // 2)
    shape = ModelShape.from_hf_config(str(tmp_path), dtype_bytes=4)
    assert shape.kv_bytes_per_token == 3 * 2 * D * 4
    assert engine.plan.kv_bytes_per_block == shape.kv_bytes_per_token * 8
    for k_cache, v_cache in engine.runner.kv_caches:
        assert k_cache.shape[1:] == v_cache.shape[1:] == (8, 1, D)
    prompt = list(range(5, 16))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    # Recompute layer 0's latent for the prompt with transformers' own modules.
    attn = hf.model.layers[0].self_attn
    with torch.no_grad():
        h = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor([prompt])))
        c, k_pe = attn.kv_a_proj_with_mqa(h).split([kv_lora_rank, 8], dim=-1)
        c = attn.kv_a_layernorm(c)
        cos, sin = hf.model.rotary_emb(h, torch.arange(len(prompt))[None])
        _, k_pe = attn_apply(k_pe[:, None], cos, sin)
    want = torch.cat((c[0], k_pe[0, 0]), dim=-1)                                  # [11, L]
    k_cache, v_cache = engine.runner.kv_caches[0]
    # One request on a fresh pool: blocks 0 and 1 in order (the block pool hands out ascending ids).
    stored = torch.cat((k_cache[:2, :, 0].reshape(16, D), v_cache[:2, :, 0].reshape(16, D)), dim=-1)
    torch.testing.assert_close(stored[:len(prompt), :latent], want, rtol=1e-5, atol=1e-5)


def attn_apply(k, cos, sin):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    return apply_rotary_pos_emb_interleave(k, k, cos, sin)


def test_mla_attention_forms_agree():
    """Expanded, absorbed (per sequence) and the batched absorbed decode give the same attention."""
    from pagedmoe.kernels.attention_ref import mla_attention_ref, mla_decode_ref, write_latent_ref

    gen = torch.Generator().manual_seed(0)
    H, R, Dn, Dr, Dv, bs, nblocks = 3, 20, 8, 6, 5, 4, 24
    L = R + Dr
    D = L // 2
    k_cache, v_cache = torch.zeros(nblocks, bs, 1, D), torch.zeros(nblocks, bs, 1, D)
    seq_lens = [7, 1, 13, 4]
    perm = torch.randperm(nblocks, generator=gen)
    tables = torch.zeros(4, 4, dtype=torch.int32)
    used = 0
    for b, n in enumerate(seq_lens):  # scattered blocks, as a long-running pool hands them out
        nb = -(-n // bs)
        tables[b, :nb] = perm[used:used + nb]
        used += nb
        slots = torch.stack([tables[b, i // bs].long() * bs + i % bs for i in range(n)])
        write_latent_ref(torch.randn(n, L, generator=gen), k_cache, v_cache, slots)
    w = torch.randn(H * (Dn + Dv), R, generator=gen) * 0.3
    # Decode: one query per sequence.
    qn, qp = torch.randn(4, H, Dn, generator=gen), torch.randn(4, H, Dr, generator=gen)
    qsl = torch.arange(5, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expanded = mla_attention_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, qsl, lens, 0.3, absorb=False)
    absorbed = mla_attention_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, qsl, lens, 0.3, absorb=True)
    batched = mla_decode_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, lens, max(seq_lens), 0.3)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batched, expanded, rtol=1e-5, atol=1e-5)
    # A scratch bound of one sequence's latents: the batch runs a sequence at a time, same result.
    one_at_a_time = mla_decode_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, lens, max(seq_lens), 0.3,
                                   max_elems=16 * 2 * D)
    torch.testing.assert_close(one_at_a_time, batched, rtol=1e-6, atol=1e-6)
    # Prefill-like: several queries per sequence, causal.
    q_lens = [3, 1, 13, 2]
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    qn, qp = torch.randn(19, H, Dn, generator=gen), torch.randn(19, H, Dr, generator=gen)
    expanded = mla_attention_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, qsl, lens, 0.3, absorb=False)
    absorbed = mla_attention_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, qsl, lens, 0.3, absorb=True)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    # Queries in chunks of 2 (scores bound H x 2 x 13), and the bound forcing the absorbed form.
    for form in (False, None):
        chunked = mla_attention_ref(qn, qp, k_cache, v_cache, w, R, Dv, tables, qsl, lens, 0.3, absorb=form,
                                    max_elems=H * 2 * 13)
        torch.testing.assert_close(chunked, expanded, rtol=1e-5, atol=1e-5)


def test_lossless_tier_and_auto_placement(tmp_path):
    """DeepSeek's routed experts take the lossless compressed tier bit-exactly like any family's, and
    under a tight budget the planner (which counts the latent KV) and the engine agree."""
    from pagedmoe import LLM, SamplingParams

    # 5 MoE layers: the CPU's plain double buffer (2 x E slots) must cost less than the resident experts
    make_tiny_checkpoint("deepseek_v3", tmp_path, seed=6, dtype=torch.bfloat16, num_hidden_layers=6)
    prompts = [list(range(3, 20)), [9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def trace(**kw):
        llm = LLM(str(tmp_path), device="cpu", dtype="bfloat16", max_model_len=64, **kw)
        captured = spy_logits(llm.engine)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return captured, llm.engine

    ref, resident = trace()
    got, engine = trace(num_gpu_experts=2, num_compressed_experts=4)
    assert engine.get_stats()["experts"] == {"resident/bf16": 10, "compressed/bf16": 20, "host/bf16": 10}
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))
    from pagedmoe.planning.kv_sizing import estimate_activation_bytes
    from pagedmoe.planning.model_shape import ModelShape
    from pagedmoe.planning.placement import Placement
    from pagedmoe.planning.planner import PlanInputs, minimum_budget_bytes

    c, dims = resident.config, resident.model.dims
    shape = ModelShape.from_model_dims(dims, resident.model.spec, 2)
    act = estimate_activation_bytes(c.max_num_batched_tokens, c.max_num_seqs, dims.hidden_size,
                                    dims.moe_intermediate_size, dims.top_k, dims.vocab_size, 2)
    need = minimum_budget_bytes(PlanInputs(shape, 0, act, 64, c.block_size, buffers="plain"),
                                Placement.resident(5, 8))
    _, small = trace(gpu_memory_gb=(need - 3 * shape.expert_bytes) / 1024 ** 3)  # resident cannot fit
    plan = small.placement_plan
    assert plan is not None and plan.mode == "paged" and small.expert_store.paged
    assert plan.kv_bytes_per_block == small.plan.kv_bytes_per_block


@pytest.mark.parametrize("family,overrides", [
    ("deepseek_v2", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, q_lora_rank=16,
                         topk_method="greedy", attention_bias=True)),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rope_interleave=False,
                         n_group=1, topk_group=1, norm_topk_prob=False)),
])
def test_config_variants_match_transformers(tmp_path, family, overrides):
    """The paths the golden checkpoints leave out: V2 with q low rank, attention biases, greedy routing,
    default rope; V3 with half-split rope, no groups, no renormalisation. Prefill + 4 decode steps."""
    from pagedmoe.config import EngineConfig
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.sampling_params import SamplingParams

    hf = make_tiny_checkpoint(family, tmp_path, seed=21, **overrides)
    engine = LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64))
    prompt = list(range(5, 30))
    tokens, ref = list(prompt), []
    with torch.no_grad():
        for _ in range(5):
            logits = hf(torch.tensor([tokens])).logits[0, -1].float()
            ref.append(logits)
            tokens.append(int(logits.argmax()))
    captured = spy_logits(engine)
    engine.add_request("r", None, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       prompt_token_ids=prompt)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(captured) == 5
    for i, (ours, want) in enumerate(zip(captured, ref)):
        assert (ours[0] - want).abs().max().item() <= 1e-4, f"step {i}"


@pytest.mark.gpu
def test_cuda_matches_transformers_and_paging_is_exact(tmp_path):
    """On CUDA (PyTorch MLA path, CUDA graphs off for MLA): float32 greedy equals transformers; bf16
    paged through VMM buffers equals bf16 resident bit for bit."""
    from pagedmoe import LLM, SamplingParams

    hf = make_tiny_checkpoint("deepseek_v3", tmp_path, seed=22, num_hidden_layers=4)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 384, (n,), generator=gen).tolist() for n in (5, 31, 17, 2, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(**kw):
        llm = LLM(str(tmp_path), device="cuda", max_model_len=96, max_num_seqs=8, **kw)
        captured = spy_logits(llm.engine, to_host=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], captured, llm.engine

    got, _, _ = run(dtype="float32", enforce_eager=True)
    with torch.no_grad():
        for p, tokens in zip(prompts, got):
            out = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
            assert out[0, len(p):].tolist() == tokens
    ref_tokens, ref_logits, _ = run(dtype="bfloat16", enforce_eager=False, expert_buffers="plain")
    tokens, logits, engine = run(dtype="bfloat16", enforce_eager=False, num_gpu_experts=3, expert_buffers="vmm")
    assert engine.runner.graphs is None
    assert tokens == ref_tokens and all(torch.equal(a, b) for a, b in zip(ref_logits, logits))
