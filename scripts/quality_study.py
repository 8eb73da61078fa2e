"""Quality of static vs dynamic (quality-aware) expert precision on the default model, on CPU.

1. Calibrate: score the first held-out files, capture each MoE layer's input and router ids, and per
   (layer, expert, precision) measure ||f_q(x) - f(x)|| / ||f(x)|| over the expert's routed tokens;
   activity = the expert's share of the layer's routed tokens (add-one smoothed).
2. For expert-memory budgets (fractions of bf16 expert bytes): static fp8/int8/int4 where they fit,
   and the PrecisionPolicy's mixed assignment at that budget (lossless bytes measured with the codec).
3. Apply each precision map by overwriting the expert rows with quantise->dequantise values and run
   `pagedmoe eval`'s evaluate() on the other held-out files (disjoint from calibration).

    PYTHONPATH=src python scripts/quality_study.py --out docs/quality.json --plot docs/quality.png
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedmoe.codecs.quant import fake_quantize
from pagedmoe.entrypoints.eval import default_dataset, evaluate, load_documents
from pagedmoe.experts.layout import row_part
from pagedmoe.experts.precision import PrecisionPolicy, QualityCosts, rung_bytes

LOSSY = ("fp8", "int8", "int4")


def expert_ffn(x, w13, w2):
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def capture_routed_inputs(engine, docs, context, max_tokens):
    """Per MoE layer: (inputs [T, H], topk weights [T, A], topk ids [T, A], routed-experts output [T, H])
    over the calibration windows."""
    moes = engine.model.moe_layers()
    seen = {m.moe_idx: [] for m in moes}
    originals = {}
    for m in moes:
        originals[m.moe_idx] = m.experts_fn

        def rec(x, w13, w2, tw, ids, _fn=m.experts_fn, _idx=m.moe_idx):
            out = _fn(x, w13, w2, tw, ids)
            seen[_idx].append(tuple(t.detach().float().clone() for t in (x, tw)) + (ids.detach().clone(),
                                                                                out.detach().float().clone()))
            return out
        m.experts_fn = rec
    try:
        evaluate(engine, docs, context, max_tokens, show_progress=False)
    finally:
        for m in moes:
            m.experts_fn = originals[m.moe_idx]
    return {i: tuple(torch.cat([c[j] for c in v]) for j in range(4)) for i, v in seen.items()}


def calibrate(store, captured, num_experts, max_rows):
    """-> (rel, counts, energy). rel[key][p] = ||f_q(x) - f(x)|| / ||f(x)|| over the expert's routed tokens
    (the issue's cost, weighted by activity later). energy[key][p] (a variant, reported separately) =
    sum_t ||g_te (f_q - f)(x_t)||^2 / sum_t ||moe_out_t||^2: the expert's share of its layer's squared
    output error, routing weights and token count included, on all of its routed tokens."""
    rel, counts, energy = {}, {}, {}
    H, I = store.hidden, store.inter
    for layer, (x, tw, ids, out) in captured.items():
        out_energy = out.pow(2).sum().clamp_min(1e-30)
        for e in range(num_experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            counts[(layer, e)] = float(tok.numel())
            row = store.row(layer, e)
            w13, w2 = row_part(row, H, I, "w13").float(), row_part(row, H, I, "w2").float()
            unseen = tok.numel() == 0
            xe = torch.randn(64, H) * x.std() if unseen else x[tok]   # unseen: a stand-in input
            ref = expert_ffn(xe, w13, w2)
            rel[(layer, e)], energy[(layer, e)] = {}, {}
            for p in LOSSY:
                d = expert_ffn(xe, fake_quantize(w13, p), fake_quantize(w2, p)) - ref
                rel[(layer, e)][p] = (d[:max_rows].norm() / ref[:max_rows].norm().clamp_min(1e-30)).item()
                g = torch.full((xe.shape[0],), 1.0 / ids.shape[1]) if unseen else tw[tok, slot]
                energy[(layer, e)][p] = ((d * g[:, None]).pow(2).sum() / out_energy).item()
    return rel, counts, energy


def lossless_ratio(store, num_layers, num_experts):
    from pagedmoe.codecs.lossless import encode

    n = 3 * store.inter * store.hidden
    raw = comp = 0
    for layer in range(num_layers):
        rows = torch.stack([store.row(layer, e)[:n] for e in range(num_experts)]).to(torch.bfloat16)
        ct = encode(rows.contiguous(), num_parts=num_experts, checksum=False)
        raw, comp = raw + rows.numel() * 2, comp + ct.nbytes
    return comp / raw


class Applier:
    """Writes precision maps into the expert rows; keeps the original rows to restore between runs."""

    def __init__(self, store, keys):
        self.store, self.n = store, 3 * store.inter * store.hidden
        self.orig = {k: store.row(*k)[:self.n].clone() for k in keys}

    def apply(self, assignment):
        H, I = self.store.hidden, self.store.inter
        for k, p in assignment.items():
            row = self.store.row(*k)
            row[:self.n].copy_(self.orig[k])
            if p in LOSSY:
                for part in ("w13", "w2"):
                    dst = row_part(row, H, I, part)
                    dst.copy_(fake_quantize(dst.clone(), p))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib-files", type=int, default=6, help="the first N held-out files calibrate")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=30000, help="scored tokens from the remaining files")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-rows", type=int, default=2048, help="calibration tokens per expert (cap)")
    ap.add_argument("--budgets", default="0.60,0.45,0.35", help="the table's budgets (fractions of bf16)")
    ap.add_argument("--extra-budgets", default="0.55,0.50,0.40,0.30,0.28",
                    help="more dynamic points for the plot")
    ap.add_argument("--out", type=Path, default=Path("docs/quality.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/quality.png"))
    args = ap.parse_args()

    import pagedmoe

    torch.manual_seed(0)
    t0 = time.perf_counter()
    llm = pagedmoe.LLM(device="cpu", dtype="float32")
    engine = llm.engine
    store = engine.expert_store
    L, E = len(engine.model.moe_layers()), engine.model.dims.num_experts
    keys = [(l, e) for l in range(L) for e in range(E)]
    docs = load_documents(default_dataset())
    calib_docs, eval_docs = docs[:args.calib_files], docs[args.calib_files:]

    captured = capture_routed_inputs(engine, calib_docs, args.context, args.calib_tokens)
    rel, counts, energy = calibrate(store, captured, E, args.max_rows)
    del captured
    costs = QualityCosts.from_counts(rel, counts)
    # Variant: costs already carry the expert's weight in its layer (activity 1 each).
    energy_costs = QualityCosts(energy, {k: 1.0 for k in energy})
    ratio = lossless_ratio(store, L, E)
    bpr = rung_bytes(store.hidden, store.inter, lossless_ratio=ratio)
    bf16_total = bpr["bf16"] * len(keys)
    policy = PrecisionPolicy(bpr, costs)
    energy_policy = PrecisionPolicy(bpr, energy_costs)
    # Control: the same ladder and byte budget, experts ranked at random (no quality information), to
    # separate what the extra bytes buy from what the quality-aware ranking buys.
    gen = torch.Generator().manual_seed(0)
    random_costs = QualityCosts(rel, {k: torch.rand(1, generator=gen).item() for k in keys})
    random_policy = PrecisionPolicy(bpr, random_costs)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s; lossless ratio {ratio:.4f}; bytes per expert {bpr}")

    applier = Applier(store, keys)
    results = []

    def run(name, assignment, budget=None):
        applier.apply(assignment)
        t = time.perf_counter()
        r = evaluate(engine, eval_docs, args.context, args.eval_tokens, show_progress=False)
        mix = {p: sum(v == p for v in assignment.values()) for p in bpr}
        row = {"scheme": name, "budget": budget, "bytes_frac": policy.total_bytes(assignment) / bf16_total,
               "perplexity": r["perplexity"], "top1": r["top1_accuracy"], "tokens": r["tokens"],
               "model_cost": policy.total_cost(assignment), "mix": mix}
        results.append(row)
        print(f"{name:<14} budget {budget if budget is not None else '-':>5} bytes {row['bytes_frac']:.3f} "
              f"ppl {row['perplexity']:.4f} top1 {row['top1']:.4f} ({time.perf_counter() - t:.0f} s) {mix}",
              flush=True)
        return row

    run("bf16", {k: "bf16" for k in keys})
    for p in LOSSY:
        run(f"static-{p}", {k: p for k in keys})
    budgets = [float(b) for b in args.budgets.split(",")]
    extra = [float(b) for b in args.extra_budgets.split(",") if b]
    plans, energy_plans = {}, {}
    for b in budgets + extra:
        plans[b] = policy.plan(int(b * bf16_total), keys)
        run("dynamic", plans[b], b)
    for b in budgets + extra[-2:]:
        energy_plans[b] = energy_policy.plan(int(b * bf16_total), keys)
        run("dynamic-energy", energy_plans[b], b)
    for b in budgets:
        run("mixed-random", random_policy.plan(int(b * bf16_total), keys), b)
    applier.apply({k: "bf16" for k in keys})

    by = {r["scheme"]: r for r in results if r["budget"] is None}
    dyn = {r["budget"]: r for r in results if r["scheme"] == "dynamic"}
    edyn = {r["budget"]: r for r in results if r["scheme"] == "dynamic-energy"}
    table = []
    for b in budgets:
        for s in ("static-fp8", "static-int8", "static-int4"):
            r = by[s]
            table.append({**r, "budget": b, "fits": r["bytes_frac"] <= b})
        table.append({**dyn[b], "fits": True})
        table.append({**edyn[b], "fits": True})
        table += [{**r, "fits": True} for r in results if r["scheme"] == "mixed-random" and r["budget"] == b]
    b_lo = min(budgets)

    def closed(r):
        return (by["static-int4"]["perplexity"] - r["perplexity"]) / \
            (by["static-int4"]["perplexity"] - by["bf16"]["perplexity"])
    gap, egap = closed(dyn[b_lo]), closed(edyn[b_lo])
    rgap = [closed(r) for r in results if r["scheme"] == "mixed-random" and r["budget"] == b_lo][0]
    out = {"calibration": {"files": list(range(args.calib_files)), "tokens": args.calib_tokens,
                           "max_rows_per_expert": args.max_rows},
           "eval": {"first_file": args.calib_files, "tokens": by["bf16"]["tokens"], "context": args.context},
           "lossless_ratio": ratio, "bytes_per_expert": bpr, "results": results, "table": table,
           "gap_closed_at": {"budget": b_lo, "dynamic": gap, "dynamic-energy": egap, "mixed-random": rgap},
           "calibration_counts": [[l, e, c] for (l, e), c in sorted(counts.items())],
           "quality_costs": costs.to_json(), "energy_costs": energy_costs.to_json(),
           "plans": {str(b): {f"{l},{e}": p for (l, e), p in plan.items()} for b, plan in plans.items()},
           "energy_plans": {str(b): {f"{l},{e}": p for (l, e), p in plan.items()}
                            for b, plan in energy_plans.items()},
           "seconds": time.perf_counter() - t0, "torch": torch.__version__}
    args.out.write_text(json.dumps(out, indent=1))
    print(f"gap closed at {b_lo:.0%}: dynamic {gap:.1%}, dynamic-energy {egap:.1%}, mixed-random {rgap:.1%}; "
          f"total {time.perf_counter() - t0:.0f} s")
    if args.plot:
        plot(results, by, args.plot)
    return 0


def plot(results, by, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    dyn = sorted((r for r in results if r["scheme"] == "dynamic"), key=lambda r: r["bytes_frac"])
    ax.plot([100 * r["bytes_frac"] for r in dyn], [r["perplexity"] for r in dyn], "o-", label="dynamic (policy)")
    edyn = sorted((r for r in results if r["scheme"] == "dynamic-energy"), key=lambda r: r["bytes_frac"])
    ax.plot([100 * r["bytes_frac"] for r in edyn], [r["perplexity"] for r in edyn], "x--",
            label="dynamic, output-energy cost (variant)")
    rnd = sorted((r for r in results if r["scheme"] == "mixed-random"), key=lambda r: r["bytes_frac"])
    ax.plot([100 * r["bytes_frac"] for r in rnd], [r["perplexity"] for r in rnd], "d:", color="gray",
            label="mixed, random ranking (control)")
    for s, m in (("static-fp8", "s"), ("static-int8", "^"), ("static-int4", "v")):
        r = by[s]
        ax.plot([100 * r["bytes_frac"]], [r["perplexity"]], m, ms=9, label=s)
    ax.axhline(by["bf16"]["perplexity"], color="gray", ls="--", label="bf16 (100% bytes)")
    ax.set_xlabel("expert memory, % of bf16")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("default model: perplexity vs expert-memory budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
