#!/usr/bin/env python3
"""Train the embedded default model: a small transformers.Qwen3MoeForCausalLM on Python source.

Inputs (from scripts/build_corpus.py and scripts/train_tokenizer.py):
  <data>/train_tokens.npz   uint16 token ids, documents joined by <|endoftext|>
  <data>/tokenizer/         Hugging Face tokenizer files
  --heldout                 src/pagedmoe/data/heldout.jsonl (committed, split by file)

The run stops itself by wall clock (--max-minutes, counted from process start, so data loading
and compilation are included), then: saves the model in bf16 as sharded safetensors, evaluates
held-out loss / perplexity / top-1 accuracy (bf16 weights, as shipped), the unigram baseline
(train-set token frequencies, add-one smoothing) and per-layer expert usage on held-out text,
and writes loss_curve.csv/json and stats.json.

Held-out protocol (what `pagedmoe eval` should reproduce): documents in file order, each
tokenized and followed by <|endoftext|>, concatenated into one stream, cut into consecutive
non-overlapping windows of --seq-len tokens; every window is scored from an empty context on
positions 1..len-1.

Expert implementation: the HF Qwen3-MoE experts module is kept (same parameters and layout,
so the checkpoint is a plain HF one); only its forward is swapped, during training, for a
grouped-GEMM version that casts the fp32 master weights to bf16 (the HF grouped_mm path runs
in the weights' dtype, i.e. fp32, and falls back to a host-synchronising loop under compile).

--pack-out DIR: the device returns at most 8 files, so weight shards go directly into DIR and
every small file (config, index, tokenizer, logs, stats) into DIR/small.tar.gz.
"""
from __future__ import annotations

import time

T_PROCESS_START = time.time()  # the wall-clock budget includes imports and data loading

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoTokenizer, GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

# torch >= 2.10 names it F.grouped_mm; 2.8-2.9 only have the private op.
grouped_mm = getattr(F, "grouped_mm", None) or torch._grouped_mm

CPU_EXPERTS_BF16 = False  # set by main() for a CPU test of the compiled path

# Shape legend: B batch, L sequence, T tokens (B*L), E experts, A active per token (top-k),
# S = T*A routed rows, H hidden, I moe intermediate, V vocab.
PRESETS = {
    # ~19.7M parameters (tied embeddings) = 39.5 MB in bf16.
    "default": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                    head_dim=64, num_experts=32, moe_intermediate_size=64, num_experts_per_tok=4),
    # CPU routing experiments: the default's expert count and top-k, narrow.
    "small": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, num_experts=32, moe_intermediate_size=32, num_experts_per_tok=4),
    # CPU smoke test: same structure, tiny sizes.
    "tiny": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, num_experts=16, moe_intermediate_size=32, num_experts_per_tok=2),
}


def log(msg: str) -> None:
    print(f"[{time.time() - T_PROCESS_START:7.1f}s] {msg}", flush=True)


def grouped_bf16_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3MoeExperts.forward with grouped GEMMs in bf16 on CUDA; no host sync (compile-friendly).

    hidden_states [T, H], top_k_index [T, A] (int64), top_k_weights [T, A] -> [T, H].
    On CPU (smoke tests only) it computes in the input dtype, as CPU bf16 GEMMs are slow, unless
    CPU_EXPERTS_BF16 is set (compiled grouped_mm accepts bf16 only).
    """
    num_tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[-1]
    dtype = torch.bfloat16 if hidden_states.is_cuda or CPU_EXPERTS_BF16 else hidden_states.dtype
    expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))  # [S] rows grouped by expert
    x = hidden_states[perm // top_k].to(dtype)  # [S, H]
    # offs[e] = rows routed to experts 0..e (exclusive end of group e); static shape [E].
    bounds = torch.arange(1, self.num_experts + 1, device=expert_ids_g.device, dtype=expert_ids_g.dtype)
    offs = torch.searchsorted(expert_ids_g, bounds, out_int32=True)
    w13 = self.gate_up_proj.to(dtype).transpose(-2, -1)  # [E, H, 2I]
    gate, up = grouped_mm(x, w13, offs=offs).chunk(2, dim=-1)  # [S, I] each
    w2 = self.down_proj.to(dtype).transpose(-2, -1)  # [E, I, H]
    y = grouped_mm(self.act_fn(gate) * up, w2, offs=offs).float()  # [S, H]
    y = y * top_k_weights.reshape(-1)[perm].float().unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    out = y[inv_perm].view(num_tokens, top_k, hidden).sum(dim=1)  # fp32 sum over the A experts
    return out.to(hidden_states.dtype)


def busiest_quarter_share(router_logits: tuple, top_k: int) -> torch.Tensor:
    """[num_layers] share of this batch's routed (token, expert) pairs taken by the busiest 25%
    of experts (uniform routing: 0.25). Static shapes, no host sync."""
    shares = []
    for logits in router_logits:  # [T, E]
        num_experts = logits.shape[-1]
        idx = logits.topk(top_k, dim=-1).indices.reshape(-1)
        counts = torch.zeros(num_experts, device=logits.device).scatter_add_(
            0, idx, torch.ones(idx.shape, device=logits.device))
        top = counts.sort(descending=True).values[: max(1, num_experts // 4)]
        shares.append(top.sum() / idx.numel())
    return torch.stack(shares)


def use_grouped_bf16_experts(model) -> None:
    for layer in model.model.layers:
        experts = layer.mlp.experts
        experts.forward = types.MethodType(grouped_bf16_experts_forward, experts)


def restore_hf_experts(model) -> None:
    for layer in model.model.layers:
        layer.mlp.experts.__dict__.pop("forward", None)


def make_config(args, vocab_size: int, eos_id: int, im_end_id: int) -> Qwen3MoeConfig:
    p = PRESETS[args.preset]
    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        intermediate_size=4 * p["hidden_size"],  # dense MLP size; unused (every layer is MoE)
        max_position_embeddings=args.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        norm_topk_prob=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        use_sliding_window=False,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        bos_token_id=eos_id,
        eos_token_id=[eos_id, im_end_id],
        pad_token_id=eos_id,
        initializer_range=0.02,
        **p,
    )


def load_heldout(path: str, tok, seq_len: int) -> tuple[torch.Tensor, int, int]:
    """-> windows [N, seq_len] (last row right-padded with -1), number of docs, UTF-8 bytes."""
    ids, n_docs, n_bytes = [], 0, 0
    with open(path) as f:
        for line in f:
            text = json.loads(line)["text"]
            ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            n_docs += 1
            n_bytes += len(text.encode())
    n_win = math.ceil(len(ids) / seq_len)
    windows = torch.full((n_win, seq_len), -1, dtype=torch.long)
    windows.view(-1)[: len(ids)] = torch.tensor(ids)
    return windows, n_docs, n_bytes


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int, device, autocast: bool, max_windows=None,
             unigram_logp=None, usage=None):
    """Mean NLL, top-1 accuracy (and unigram NLL, expert usage) over held-out windows."""
    model.eval()
    nll_sum, correct, count, uni_sum = 0.0, 0, 0, 0.0
    hooks, state = [], {}
    if usage is not None:
        for i, layer in enumerate(model.model.layers):
            def hook(mod, inp, out, i=i):
                idx = out[2][state["mask"]]  # router_indices [T, A] of the real (unpadded) tokens
                usage[i] += torch.bincount(idx.reshape(-1), minlength=usage.shape[1]).cpu()
            hooks.append(layer.mlp.gate.register_forward_hook(hook))
    wins = windows if max_windows is None else windows[:max_windows]
    for s in range(0, len(wins), batch):
        w = wins[s: s + batch].to(device)
        valid = w >= 0
        x = w.clamp(min=0)
        if usage is not None:
            state["mask"] = valid.reshape(-1)  # padded positions do not count as routed tokens
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=x, use_cache=False).logits.float()  # [B, L, V]
        tgt = w[:, 1:]
        m = valid[:, 1:]
        lp = torch.log_softmax(logits[:, :-1], dim=-1)
        tl = lp.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        nll_sum += -(tl[m]).double().sum().item()
        correct += (logits[:, :-1].argmax(-1) == tgt)[m].sum().item()
        count += m.sum().item()
        if unigram_logp is not None:
            uni_sum += -(unigram_logp[tgt.clamp(min=0)][m]).double().sum().item()
    for h in hooks:
        h.remove()
    model.train()
    out = {"nll": nll_sum / count, "ppl": math.exp(nll_sum / count), "top1_acc": correct / count,
           "tokens": count}
    if unigram_logp is not None:
        out["unigram_nll"] = uni_sum / count
        out["unigram_ppl"] = math.exp(uni_sum / count)
    return out


def usage_stats(counts: torch.Tensor) -> list[dict]:
    """Per layer: share of routed (token, expert) assignments taken by the busiest 25% of experts."""
    rows = []
    for i, c in enumerate(counts.double()):
        share = c / c.sum()
        q = max(1, len(c) // 4)
        top = share.sort(descending=True).values
        ent = -(share[share > 0] * share[share > 0].log()).sum().item()
        rows.append({"layer": i, "top25pct_share": top[:q].sum().item(), "max_share": top[0].item(),
                     "min_share": top[-1].item(), "experts_under_1pct": int((share < 0.01).sum()),
                     "usage_perplexity": math.exp(ent), "counts": c.long().tolist()})
    return rows


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:
        return None


def save_model(model, tok_dir: str, out_dir: str, gen_cfg: GenerationConfig) -> None:
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, max_shard_size="15MB")
    gen_cfg.save_pretrained(out_dir)
    # transformers 5 writes the expert count only as "num_local_experts" (its attribute_map alias);
    # Qwen3-MoE checkpoints and transformers 4.x read "num_experts", so write both.
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["num_experts"] = model.config.num_experts
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    # The tokenizer files exactly as train_tokenizer.py wrote them (a re-save would rename
    # the tokenizer class and drop special_tokens_map.json).
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), os.path.join(out_dir, name))


def pack(model_dir: str, extra_files: list[str], pack_out: str) -> None:
    """Shards straight into pack_out; everything else into pack_out/small.tar.gz."""
    os.makedirs(pack_out, exist_ok=True)
    with tarfile.open(os.path.join(pack_out, "small.tar.gz"), "w:gz") as tar:
        for name in sorted(os.listdir(model_dir)):
            src = os.path.join(model_dir, name)
            if name.endswith(".safetensors"):
                shutil.copy(src, os.path.join(pack_out, name))
            else:
                tar.add(src, arcname=name)
        for f in extra_files:
            if os.path.exists(f):
                tar.add(f, arcname=os.path.basename(f))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=".carry")
    ap.add_argument("--heldout", default="src/pagedmoe/data/heldout.jsonl")
    ap.add_argument("--out", required=True, help="model folder (HF layout) and logs")
    ap.add_argument("--pack-out", default=None, help="also write shards + small.tar.gz here")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="default")
    ap.add_argument("--max-minutes", type=float, default=7.5)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-position-embeddings", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=150)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=1e-3, help="router load-balancing loss coefficient")
    ap.add_argument("--max-share", type=float, default=0.70,
                    help="skew guard: busiest-25%%-of-experts share above which the aux coefficient grows")
    ap.add_argument("--max-aux-coef", type=float, default=0.05)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                    help="auto: time eager steps, then compiled steps, keep the faster")
    ap.add_argument("--target-epochs", type=float, default=8.0,
                    help="--compile auto skips compiling when eager speed reaches this many epochs")
    ap.add_argument("--eval-every-s", type=float, default=45.0)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows in periodic evals")
    ap.add_argument("--reserve-s", type=float, default=5.0, help="stop this early before the deadline")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-eval-windows", type=int, default=None, help="cap the final evaluation (CPU tests)")
    args = ap.parse_args()

    deadline = T_PROCESS_START + args.max_minutes * 60 - args.reserve_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # bf16 autocast on CUDA; on CPU (smoke tests only) bf16 matmuls are slow, so fp32 there.
    use_autocast = device.type == "cuda"
    global CPU_EXPERTS_BF16
    CPU_EXPERTS_BF16 = args.compile == "on"
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else ""))

    tok = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"))
    im_end_id = tok.convert_tokens_to_ids("<|im_end|>")
    tokens_np = np.load(os.path.join(args.data, "train_tokens.npz"))["tokens"]
    data = torch.from_numpy(tokens_np.astype(np.int32)).to(device)
    n_train = data.numel()
    vocab = len(tok)
    log(f"train tokens {n_train:,}, vocab {vocab}")
    heldout, n_docs, n_bytes = load_heldout(args.heldout, tok, args.seq_len)
    log(f"held-out: {n_docs} docs, {n_bytes:,} bytes, {int((heldout >= 0).sum()):,} tokens, {len(heldout)} windows")

    config = make_config(args, vocab, tok.eos_token_id, im_end_id)
    model = Qwen3MoeForCausalLM(config).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_active = n_params - n_expert + n_expert * config.num_experts_per_tok // config.num_experts
    log(f"model: {n_params / 1e6:.2f}M params ({n_expert / 1e6:.2f}M in experts, "
        f"{n_active / 1e6:.2f}M active per token), {2 * n_params / 1e6:.1f} MB in bf16")
    use_grouped_bf16_experts(model)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    # NOTE: the aux coefficient is a tensor so that changing it does not recompile loss_fn.
    aux_coef = torch.tensor(args.aux_coef, device=device)

    def loss_fn(x, y, coef):
        out = model(input_ids=x, use_cache=False, output_router_logits=True)
        ce = F.cross_entropy(out.logits.float().view(-1, vocab), y.reshape(-1))
        aux = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok)
        with torch.no_grad():
            shares = busiest_quarter_share(out.router_logits, config.num_experts_per_tok)
        return ce + coef * aux, ce.detach(), aux.detach(), shares

    def batch():
        starts = torch.randint(0, n_train - args.seq_len - 1, (args.batch_size,), device=device)
        idx = starts[:, None] + torch.arange(args.seq_len + 1, device=device)[None]
        w = data[idx].long()  # [B, L+1]
        return w[:, :-1], w[:, 1:]

    step_fn = loss_fn
    compile_state = {"mode": args.compile, "eager_tok_s": None, "compiled_tok_s": None,
                     "compile_s": None, "used": False, "error": None}
    tokens_per_step = args.batch_size * args.seq_len
    curve, t_train0 = [], time.time()
    last_eval = t_train0
    step, tokens_seen = 0, 0
    ab_marks = {}  # phase -> (step, time) for throughput measurement

    def lr_at(step_i: int, now: float) -> float:
        if step_i < args.warmup_steps:
            return args.lr * (step_i + 1) / args.warmup_steps
        frac = min(1.0, (now - t_train0) / max(1.0, deadline - t_train0))
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    log(f"training: batch {args.batch_size} x {args.seq_len} = {tokens_per_step} tokens/step, "
        f"deadline in {deadline - time.time():.0f}s")
    train_error = None
    try:
        while True:
            now = time.time()
            if now >= deadline or (args.max_steps is not None and step >= args.max_steps):
                break
            # Compile A/B: eager steps 3..12 are timed, then compiled steps 14..23 (13 compiles).
            if args.compile != "off" and compile_state["error"] is None and step in (3, 13, 14, 24):
                sync()
                ab_marks[step] = time.time()
                if step == 13 and compile_state["eager_tok_s"] is None:
                    eager = compile_state["eager_tok_s"] = 10 * tokens_per_step / (ab_marks[13] - ab_marks[3])
                    epochs = eager * (deadline - time.time()) / n_train
                    # Compiling costs a minute or so; skip it when eager speed already gives
                    # --target-epochs over the data (the unique data, not speed, limits quality).
                    if args.compile == "auto" and epochs >= args.target_epochs:
                        compile_state["error"] = f"skipped: eager reaches {epochs:.1f} epochs"
                        log(f"eager: {eager:,.0f} tokens/s = {epochs:.1f} epochs by the deadline; not compiling")
                    else:
                        log(f"eager: {eager:,.0f} tokens/s = {epochs:.1f} epochs by the deadline; compiling")
                        step_fn = torch.compile(loss_fn)
                if step == 14 and 13 in ab_marks:
                    compile_state["compile_s"] = ab_marks[14] - ab_marks[13]
                    log(f"first compiled step took {compile_state['compile_s']:.1f}s")
                if step == 24 and 14 in ab_marks:
                    c = 10 * tokens_per_step / (ab_marks[24] - ab_marks[14])
                    compile_state["compiled_tok_s"] = c
                    keep = args.compile == "on" or c > 1.05 * compile_state["eager_tok_s"]
                    compile_state["used"] = keep
                    if not keep:
                        step_fn = loss_fn
                    log(f"compiled: {c:,.0f} tokens/s -> using {'compiled' if keep else 'eager'}")
            lr = lr_at(step, now)
            for g in opt.param_groups:
                g["lr"] = lr
            x, y = batch()
            try:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_autocast):
                    loss, ce, aux, shares = step_fn(x, y, aux_coef)
                loss.backward()
            except Exception as e:  # a compile failure falls back to eager, once
                if step_fn is loss_fn:
                    raise
                compile_state["error"] = f"{type(e).__name__}: {e}"[:2000]
                log(f"compiled step failed, back to eager: {compile_state['error'][:300]}")
                step_fn = loss_fn
                opt.zero_grad(set_to_none=True)
                continue
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            tokens_seen += tokens_per_step
            if step % args.log_every == 0 or step in (1, 10):
                elapsed = time.time() - t_train0
                share_list = shares.tolist()
                row = {"step": step, "tokens": tokens_seen, "time_s": round(time.time() - T_PROCESS_START, 2),
                       "train_loss": ce.item(), "aux_loss": aux.item(), "grad_norm": gnorm.item(),
                       "lr": lr, "tokens_per_s": tokens_seen / elapsed, "aux_coef": aux_coef.item(),
                       "max_top25_share": max(share_list), "top25_share": share_list}
                # Skew guard: a small aux coefficient lets routing skew (wanted) but it must not
                # collapse onto a few experts. Above --max-share in any layer the coefficient
                # grows; it relaxes back toward --aux-coef once every layer is well below.
                if step > args.warmup_steps:
                    c = aux_coef.item()
                    if max(share_list) > args.max_share:
                        aux_coef.fill_(min(c * 1.5, args.max_aux_coef))
                    elif max(share_list) < args.max_share - 0.15 and c > args.aux_coef:
                        aux_coef.fill_(max(c / 1.5, args.aux_coef))
                if time.time() - last_eval >= args.eval_every_s:
                    r = evaluate(model, heldout, args.batch_size, device, use_autocast, max_windows=args.eval_windows)
                    row["val_loss"] = r["nll"]
                    last_eval = time.time()
                curve.append(row)
                log(f"step {step:5d} tok {tokens_seen / 1e6:7.1f}M loss {row['train_loss']:.3f} "
                    f"aux {row['aux_loss']:.3f} x{row['aux_coef']:.4f} top25 {row['max_top25_share']:.2f} "
                    f"gn {row['grad_norm']:.2f} lr {lr:.2e} "
                    f"{row['tokens_per_s']:,.0f} tok/s" + (f" val {row['val_loss']:.3f}" if "val_loss" in row else ""))
                if not math.isfinite(row["train_loss"]):
                    raise FloatingPointError("loss is not finite")
    except Exception as e:
        train_error = f"{type(e).__name__}: {e}"
        log("training stopped by an error (the model so far is still saved):\n" + traceback.format_exc())
    sync()
    train_s = time.time() - t_train0
    log(f"training done: {step} steps, {tokens_seen / 1e6:.1f}M tokens in {train_s:.0f}s "
        f"({tokens_seen / max(train_s, 1e-9):,.0f} tok/s overall)")

    # Save first (bf16, plain HF experts forward), so a failing evaluation loses nothing.
    os.makedirs(args.out, exist_ok=True)
    fp32_eval = evaluate(model, heldout, args.batch_size, device, use_autocast, max_windows=args.max_eval_windows)
    log(f"held-out (fp32 master weights, bf16 autocast): loss {fp32_eval['nll']:.4f} ppl {fp32_eval['ppl']:.2f}")
    restore_hf_experts(model)
    model.config.router_aux_loss_coef = aux_coef.item()  # the coefficient in force at the end
    model.to(torch.bfloat16)
    gen_cfg = GenerationConfig(bos_token_id=tok.eos_token_id, eos_token_id=[tok.eos_token_id, im_end_id],
                               pad_token_id=tok.eos_token_id)
    model_dir = os.path.join(args.out, "model")
    save_model(model, os.path.join(args.data, "tokenizer"), model_dir, gen_cfg)
    curve_csv = os.path.join(args.out, "loss_curve.csv")
    keys = ["step", "tokens", "time_s", "train_loss", "val_loss", "aux_loss", "aux_coef", "max_top25_share",
            "grad_norm", "lr", "tokens_per_s"]
    with open(curve_csv, "w") as f:
        f.write(",".join(keys) + "\n")
        for r in curve:
            f.write(",".join("" if r.get(k) is None else f"{r[k]:.6g}" for k in keys) + "\n")
    stats_path = os.path.join(args.out, "stats.json")
    extra = [curve_csv, stats_path, os.path.join(args.out, "train.log")]
    if args.pack_out:
        pack(model_dir, extra, args.pack_out)
        log("packed shards (the bf16 weights) before evaluation")

    stats = {
        "commit": git_commit(), "torch": torch.__version__, "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "args": vars(args), "preset": PRESETS[args.preset],
        "params": n_params, "expert_params": n_expert, "active_params_per_token": n_active,
        "bf16_bytes": 2 * n_params, "train_tokens_unique": n_train, "tokens_seen": tokens_seen,
        "epochs": tokens_seen / n_train, "steps": step, "train_seconds": train_s,
        "total_seconds_to_stop": time.time() - T_PROCESS_START,
        "tokens_per_s": tokens_seen / max(train_s, 1e-9), "compile": compile_state,
        "train_error": train_error, "heldout_fp32_master": fp32_eval,
        "max_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
        "heldout_protocol": "docs in file order, each + <|endoftext|>, concatenated, non-overlapping "
                            f"{args.seq_len}-token windows, positions 1..len-1 scored",
    }
    try:
        # Unigram baseline from train-set frequencies, add-one smoothing.
        counts = torch.bincount(data.long(), minlength=vocab).double()
        unigram_logp = ((counts + 1) / (counts.sum() + vocab)).log().float().to(device)
        usage = torch.zeros(config.num_hidden_layers, config.num_experts, dtype=torch.long)
        ev = evaluate(model, heldout, args.batch_size, device, False, max_windows=args.max_eval_windows,
                      unigram_logp=unigram_logp, usage=usage)
        stats["heldout"] = {**ev, "docs": n_docs, "bytes": n_bytes,
                            "bits_per_byte": ev["nll"] * ev["tokens"] / math.log(2) / n_bytes}
        stats["expert_usage"] = usage_stats(usage)
        log(f"held-out (bf16 weights): loss {ev['nll']:.4f} ppl {ev['ppl']:.2f} top1 {ev['top1_acc']:.3f} "
            f"| unigram ppl {ev['unigram_ppl']:.1f}")
        for r in stats["expert_usage"]:
            log(f"layer {r['layer']}: busiest 25% of experts take {100 * r['top25pct_share']:.1f}% of routed "
                f"tokens (max {100 * r['max_share']:.1f}%, min {100 * r['min_share']:.2f}%, "
                f"{r['experts_under_1pct']} under 1%)")
        prompt = "def fibonacci(n):\n"
        ids = tok(prompt, return_tensors="pt").input_ids.to(device)
        gen = model.generate(ids, max_new_tokens=64, do_sample=False, generation_config=gen_cfg)
        stats["sample"] = {"prompt": prompt, "greedy_64": tok.decode(gen[0, ids.shape[1]:])}
        log("sample:\n" + prompt + stats["sample"]["greedy_64"])
        msgs = [{"role": "user", "content": "Write a Python function `is_prime(n)`: Return True if n is prime."}]
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"].to(device)
        gen = model.generate(ids, max_new_tokens=96, do_sample=False, generation_config=gen_cfg)
        stats["chat_sample"] = {"messages": msgs, "greedy_96": tok.decode(gen[0, ids.shape[1]:])}
        log("chat sample:\n" + stats["chat_sample"]["greedy_96"])
    except Exception:
        stats["eval_error"] = traceback.format_exc()
        log("evaluation failed:\n" + stats["eval_error"])
    stats["curve"] = curve
    with open(stats_path, "w") as f:
        json.dump(stats, f, indent=1)
    with open(os.path.join(args.out, "loss_curve.json"), "w") as f:
        json.dump(curve, f)
    extra.append(os.path.join(args.out, "loss_curve.json"))
    if args.pack_out:
        sys.stdout.flush()
        pack(model_dir, extra, args.pack_out)
    log("done")


if __name__ == "__main__":
    main()
