#!/usr/bin/env python3
"""Plots for the default model's card, from the stats.json that train_default_model.py writes.

  docs/default-model-loss.png     train loss (and held-out loss) against tokens seen
  docs/default-model-experts.png  per layer, each expert's share of routed tokens on held-out text,
                                  sorted, against the uniform share

Usage: python scripts/plot_default_model.py STATS_JSON [--out-dir docs]
"""
from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_loss(stats: dict, path: str) -> None:
    curve = stats["curve"]
    tok = [r["tokens"] / 1e6 for r in curve]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(tok, [r["train_loss"] for r in curve], lw=1.2, label="train loss (batch)")
    val = [(r["tokens"] / 1e6, r["val_loss"]) for r in curve if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=3, lw=1.2, label="held-out loss (first 64 windows)")
    ho = stats.get("heldout")
    if ho:
        ax.axhline(ho["unigram_nll"], ls="--", c="gray", lw=1,
                   label=f"unigram baseline (ppl {ho['unigram_ppl']:.0f})")
        ax.axhline(ho["nll"], ls=":", c="k", lw=1, label=f"final held-out, bf16 (ppl {ho['ppl']:.2f})")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(0, max(9.5, ho["unigram_nll"] + 0.5) if ho else None)
    ax.set_title(f"default model: {stats['params'] / 1e6:.1f}M params, {stats['steps']} steps, "
                 f"{stats['train_seconds'] / 60:.1f} min on {stats['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_experts(stats: dict, path: str) -> None:
    rows = stats["expert_usage"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in rows:
        total = sum(r["counts"])
        shares = sorted((100 * c / total for c in r["counts"]), reverse=True)
        ax.plot(range(1, len(shares) + 1), shares, marker=".", lw=1,
                label=f"layer {r['layer']} (top 25%: {100 * r['top25pct_share']:.0f}%)")
    n = len(rows[0]["counts"])
    ax.axhline(100 / n, ls="--", c="gray", lw=1, label=f"uniform ({100 / n:.2f}%)")
    ax.set_xlabel("expert rank (busiest first)")
    ax.set_ylabel("share of routed tokens on held-out text (%)")
    ax.set_title("expert usage per layer", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stats")
    ap.add_argument("--out-dir", default="docs")
    args = ap.parse_args()
    with open(args.stats) as f:
        stats = json.load(f)
    os.makedirs(args.out_dir, exist_ok=True)
    plot_loss(stats, os.path.join(args.out_dir, "default-model-loss.png"))
    if stats.get("expert_usage"):
        plot_experts(stats, os.path.join(args.out_dir, "default-model-experts.png"))
    print(f"wrote plots to {args.out_dir}")


if __name__ == "__main__":
    main()
