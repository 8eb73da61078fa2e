"""`pagedmoe eval`: perplexity and next-token top-1 accuracy over a held-out set, expert usage per layer."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

from pagedmoe.config import add_engine_args, engine_config_from_args
from pagedmoe.engine.limits import jsonl_strings, read_utf8


DEFAULT_CONTEXT = 512   # tokens per scored window


def default_dataset() -> Path:
    return Path(__file__).resolve().parent.parent / "data" / "heldout.jsonl"


def register(sub) -> None:
    p = sub.add_parser("eval", help="perplexity and top-1 accuracy on a held-out set",
                       description="Evaluate a model on held-out text (default: the set shipped with the "
                                   "default model).")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--dataset", type=Path, default=None,
                   help="a .jsonl with a 'text' field per document, or a plain text file")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after scoring this many tokens")
    p.add_argument("--context", type=int, default=None,
                   help=f"tokens per scored window (default: {DEFAULT_CONTEXT}, or the model's max_model_len where "
                        f"shorter)")
    p.add_argument("--output-json", type=Path, default=Path("eval-results.json"))
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of per-layer expert usage")
    add_engine_args(p)
    p.set_defaults(func=run)


def load_documents(path: Path) -> list[str]:
    if not path.is_file():
        raise FileNotFoundError(f"dataset {path} does not exist")
    text = read_utf8(path, "dataset")
    if path.suffix == ".jsonl":
        return jsonl_strings(path, text, "text", "a JSON object with a 'text' field", "'text'")
    return [text]


def evaluate(engine, documents: list[str], context: Optional[int], max_tokens=None, show_progress: bool = True
             ) -> dict:
    """Non-overlapping windows of `context` tokens per document (None: DEFAULT_CONTEXT, at most the engine's
    max_model_len); every token after the first of a window is predicted from the ones before it."""
    import torch

    if engine.tokenizer is None:
        raise ValueError("evaluation needs a tokenizer")
    if context is None:
        context = min(DEFAULT_CONTEXT, engine.max_model_len)
    elif context > engine.max_model_len:  # a window the engine cannot score whole: not silently shortened
        raise ValueError(f"--context {context} exceeds max_model_len {engine.max_model_len}")
    if context < 2:
        raise ValueError("--context must be at least 2")
    windows = []
    for doc in documents:
        # verbose=False: a document longer than the tokenizer's model_max_length is cut into windows below,
        # so transformers' warning ("... will result in indexing errors") is wrong here
        ids = engine.tokenizer.encode(doc, verbose=False)
        windows += [ids[i:i + context] for i in range(0, len(ids), context) if len(ids[i:i + context]) > 1]
    budget = max_tokens if max_tokens is not None else sum(len(w) - 1 for w in windows)
    nll, correct, scored = 0.0, 0, 0
    start = time.perf_counter()
    bar = tqdm(total=budget, unit="tok", desc="Evaluating", disable=not show_progress)
    for window in windows:
        if scored >= budget:
            break
        logits = engine.score(window)[:-1]
        targets = torch.tensor(window[1:])
        n = min(len(targets), budget - scored)
        logp = torch.log_softmax(logits[:n].double(), dim=-1)
        nll -= logp.gather(1, targets[:n, None]).sum().item()
        correct += (logits[:n].argmax(-1) == targets[:n]).sum().item()
        scored += n
        bar.update(n)
    bar.close()
    if scored == 0:
        raise ValueError("the dataset has no tokens to score")
    activity = engine.activity.snapshot()["total"]
    return {"tokens": scored, "context": context, "perplexity": math.exp(nll / scored), "mean_nll": nll / scored,
            "top1_accuracy": correct / scored, "seconds": time.perf_counter() - start,
            "expert_usage": activity}


def plot_expert_usage(usage: list[list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = np.array(usage, dtype=float)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(6, counts.shape[1] * 0.35), max(3, counts.shape[0] * 0.5)))
    im = ax.imshow(share, aspect="auto", cmap="viridis")
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label="share of routed tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> int:
    from pagedmoe.engine.llm_engine import LLMEngine
    from pagedmoe.experts.activity import busiest_quarter_share
    from pagedmoe.extras import require

    # every check before the model loads and the evaluation runs, not after them
    if args.plot:
        require("matplotlib", "plot", "eval --plot")
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.tensor_parallel_size > 1:  # LLMEngine.score runs on one process: refused before the ranks start
        raise ValueError("pagedmoe eval does not support --tensor-parallel-size > 1 yet")
    docs = load_documents(args.dataset or default_dataset())
    engine = LLMEngine(engine_config_from_args(args, model=args.model))
    r = evaluate(engine, docs, args.context, args.max_tokens)
    shares = busiest_quarter_share(r["expert_usage"])
    print(f"{'model':<24} {'tokens':>8} {'perplexity':>11} {'top-1 acc':>10} {'busiest 25% share':>18}")
    print(f"{engine.served_model_name:<24} {r['tokens']:>8} {r['perplexity']:>11.3f} {r['top1_accuracy']:>10.4f} "
          f"{sum(shares) / len(shares):>18.3f}")
    r["busiest_quarter_share"] = shares
    r["model"] = engine.model_path
    args.output_json.parent.mkdir(parents=True, exist_ok=True)  # as bench and plan do
    args.output_json.write_text(json.dumps(r, indent=2))
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_expert_usage(r["expert_usage"], args.plot, f"expert usage: {engine.served_model_name}")
    return 0
