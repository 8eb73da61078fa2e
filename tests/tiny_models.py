"""Tiny random checkpoints written by transformers itself: the golden reference for the engine."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 384
TEXT = ("def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
        "        self.x = x\n        self.y = y\n\nprint('hello world')\nfor i in range(10):\n"
        "    total += i * i\n") * 4


def tiny_hf_config(family: str, **overrides):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
                  pad_token_id=0)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=32, num_local_experts=8, **common)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, num_experts=8,
                                          norm_topk_prob=False, **common)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                                          head_dim=16, norm_topk_prob=True, **common)
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=32, num_experts=8, **common)
    elif family == "glm4_moe":
        # Layer 0 dense, layers 1-2 MoE; 4 groups of 2 experts, the best 2 groups compete; half of
        # each head rotates; every optional path on (bias, qk norm, shared expert, scaling).
        common = dict(common, num_hidden_layers=3)
        cfg = transformers.Glm4MoeConfig(intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
                                         n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                                         routed_scaling_factor=2.5, norm_topk_prob=True, head_dim=16,
                                         partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=True,
                                         **common)
    elif family in ("deepseek_v2", "deepseek_v3"):
        # MLA: q/kv low-rank projections, the latent (kv_lora_rank + qk_rope_head_dim) in the cache;
        # HF's MLA needs num_key_value_heads == num_attention_heads. Layer 0 dense, layers 1-2 MoE.
        common = dict(common, num_hidden_layers=3, num_key_value_heads=4)
        mla = dict(kv_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                   intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, first_k_dense_replace=1)
        if family == "deepseek_v2":
            # V2-Lite-like: no q low rank, softmax group-limited greedy routing, YaRN with mscale 0.707
            # (attention factor 1, softmax scale mscale^2); interleaved rope (complex form).
            cfg = transformers.DeepseekV2Config(
                q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                routed_scaling_factor=1.5, norm_topk_prob=False,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                                     mscale_all_dim=0.707, beta_fast=32, beta_slow=1,
                                     original_max_position_embeddings=64), **mla, **common)
        else:
            # V3-like: q low rank, sigmoid grouped routing with the correction bias, YaRN with
            # mscale 1 / mscale_all_dim 0.8 (attention factor != 1), interleaved rope.
            cfg = transformers.DeepseekV3Config(
                q_lora_rank=32, n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                norm_topk_prob=True, rope_interleave=True,
                rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=1.0,
                                     mscale_all_dim=0.8, beta_fast=32, beta_slow=1,
                                     original_max_position_embeddings=64), **mla, **common)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    n, kinds = cfg.num_hidden_layers, getattr(cfg, "layer_types", None)
    if kinds is not None and len(kinds) != n and "layer_types" not in overrides:
        # some transformers versions fix layer_types at construction (one kind per layer)
        if len(set(kinds)) != 1:
            raise ValueError(f"{family}: num_hidden_layers={n} against layer_types {kinds}: pass layer_types too")
        cfg.layer_types = [kinds[0]] * n
    return cfg


def save_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    fast.save_pretrained(str(path))


def make_tiny_checkpoint(family: str, path: Path, seed: int = 0, dtype=torch.float32,
                         max_shard_size: str | None = None, **overrides):
    """Write a random checkpoint + tokenizer to `path`; return the transformers model (float32, eval)."""
    import transformers

    torch.manual_seed(seed)
    cfg = tiny_hf_config(family, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # Random init is small; widen the router so top-k choices are decisive and outputs vary.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif p.ndim >= 2:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zeros at init: make it steer the choice
                b.normal_(0.0, 0.1)
    model = model.to(dtype).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), **kwargs)
    save_tokenizer(path)
    return model


def fp8_quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [O, I] -> (fp8 e4m3 weight, float32 scale_inv [ceil(O/bo), ceil(I/bi)]), amax / 448 per block,
    as DeepSeek-V3's checkpoints are made."""
    O, I = w.shape
    bo, bi = block
    nb_o, nb_i = -(-O // bo), -(-I // bi)
    padded = torch.zeros(nb_o * bo, nb_i * bi, dtype=torch.float32)
    padded[:O, :I] = w.float()
    blocks = padded.view(nb_o, bo, nb_i, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0                       # [nb_o, nb_i]
    q = (blocks / scale[:, None, :, None]).view(nb_o * bo, nb_i * bi)[:O, :I].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def write_fp8_checkpoint(hf_model, src: Path, dst: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Rewrite a tiny DeepSeek-V3 checkpoint the way the real one is stored: per-expert tensors, every
    linear weight but embeddings, lm_head and the router in fp8 with `weight_scale_inv` blocks (the
    scales in a second shard, so pairs cross shards), quantization_config in config.json.
    Returns the dequantised float32 state dict (per-expert names) the loader must reproduce."""
    import json
    import shutil

    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    state = {}
    for name, t in hf_model.state_dict().items():
        if name.endswith("experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                state[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("experts.down_proj"):
            prefix = name[:-len("down_proj")]
            for e in range(t.shape[0]):
                state[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            state[name] = t
    weights, scales, dequantised = {}, {}, {}
    for name, t in state.items():
        quantise = (t.ndim == 2 and name.endswith(".weight") and "embed_tokens" not in name
                    and not name.startswith("lm_head") and not name.endswith("mlp.gate.weight"))
        if quantise:
            q, s = fp8_quantize_blocks(t, block)
            weights[name], scales[name + "_scale_inv"] = q, s
            full = s.repeat_interleave(block[0], 0)[:t.shape[0]].repeat_interleave(block[1], 1)[:, :t.shape[1]]
            dequantised[name] = q.float() * full
        else:
            weights[name] = t.contiguous()
            dequantised[name] = t.float()
    save_file(weights, str(dst / "model-00001-of-00002.safetensors"))
    save_file(scales, str(dst / "model-00002-of-00002.safetensors"))
    index = {"metadata": {}, "weight_map": {**{n: "model-00001-of-00002.safetensors" for n in weights},
                                            **{n: "model-00002-of-00002.safetensors" for n in scales}}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dequantised


def spy_logits(engine, to_host: bool = False) -> list:
    """The logits of every sampling step of `engine`, in order, appended to the returned list as they are sampled
    (a clone; moved to the host if to_host). Plain and async-scheduled steps both sample through
    Sampler.sample_device, so this sees both (async scheduling is the default on CUDA)."""
    captured, orig = [], engine.sampler.sample_device

    def spy(logits, *rest):
        captured.append(logits.detach().cpu().clone() if to_host else logits.clone())
        return orig(logits, *rest)

    engine.sampler.sample_device = spy
    return captured


def greedy_logits(llm, lengths, max_tokens: int, seed: int, vocab: int = 384):
    """(logits of every sampling step, on the host; the outputs) of `llm` greedily completing random token
    prompts of `lengths`: what the paging and precision tests compare across placements."""
    from pagedmoe import SamplingParams

    captured = spy_logits(llm.engine, to_host=True)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return captured, outs
