"""Quality of static vs dynamic (quality-aware) expert precision on the default model, on CPU.

1. Calibrate: score the first held-out files, capture each MoE layer's input and router ids, and per
   (layer, expert, precision) measure ||f_q(x) - f(x)|| / ||f(x)|| over the expert's routed tokens;
   activity = the expert's share of the layer's routed tokens (add-one smoothed).
2. For expert-memory budgets (fractions of bf16 expert bytes): static fp8/int8/int4 where they fit,
   and dynamic at that budget (ladder bf16 -> fp8 -> int8 -> int4: float32 compute, and the runtime's
   lossless rung holds bf16 weights only).
3. Run each scheme through the real `--expert-precision dynamic` runtime: static maps are built and
   published by DynamicExperts (experts dequantised into the paged compute buffers), dynamic maps are
   reached by the DynamicPrecisionManager's controller demoting under a byte target; then `pagedmoe
   eval`'s evaluate() on the other held-out files (disjoint from calibration).

    PYTHONPATH=src python scripts/quality_study.py --out docs/quality.json --plot docs/quality.png
    PYTHONPATH=src python scripts/quality_study.py --prompt-shift docs/precision_shift.png
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedmoe.codecs.quant import fake_quantize
from pagedmoe.experts.layout import row_part
from pagedmoe.entrypoints.eval import default_dataset, evaluate, load_documents
from pagedmoe.experts.dynamic.precision import PrecisionPolicy, QualityCosts, rung_bytes

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


class Runtime:
    """Precision maps applied through the real `--expert-precision dynamic` runtime: static maps are
    built and published by DynamicExperts; dynamic maps come from the DynamicPrecisionManager's own
    controller (`demote_to`: its ranking, one rung per expert per round, its per-round byte cap)."""

    def __init__(self, engine, bf16_bytes):
        self.mgr, self.rt = engine.precision, engine.expert_store.dynamic
        # NOTE: the model computes in float32 on CPU, but bytes are counted as a bf16 deployment would
        # hold them, so the controller ranks moves as it would on the GPU.
        self.mgr.policy.bytes_per_rung["bf16"] = bf16_bytes

    def reset(self, costs):
        keys = self.rt.keys
        self.rt.build_all({k: "bf16" for k in keys})
        self.mgr.controller.assignment = {k: "bf16" for k in keys}
        c = self.mgr.costs          # the policy holds this object: update it in place
        c.rel_error = {k: dict(v) for k, v in costs.rel_error.items()}
        c.activity = dict(costs.activity)

    def static(self, precision):
        self.rt.build_all({k: precision for k in self.rt.keys})
        return {k: precision for k in self.rt.keys}

    def dynamic(self, target_bytes):
        rounds = self.mgr.demote_to(target_bytes)
        assert self.mgr.assignment == {k: self.rt.precision(*k) for k in self.rt.keys}
        return dict(self.mgr.assignment), rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib-files", type=int, default=6, help="the first N held-out files calibrate")
    ap.add_argument("--calib-tokens", type=int, default=8192)
    ap.add_argument("--eval-tokens", type=int, default=20000, help="scored tokens from the remaining files")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--max-rows", type=int, default=2048, help="calibration tokens per expert (cap)")
    ap.add_argument("--budgets", default="0.60,0.45,0.35", help="the table's budgets (fractions of bf16)")
    ap.add_argument("--extra-budgets", default="0.55,0.50,0.40,0.30",
                    help="more dynamic points for the plot")
    ap.add_argument("--out", type=Path, default=Path("docs/quality.json"))
    ap.add_argument("--plot", type=Path, default=Path("docs/quality.png"))
    ap.add_argument("--prompt-shift", type=Path, default=None,
                    help="instead: run the prompt-shift experiment (code, then prose) and plot the precision "
                         "map over time to this PNG (its JSON next to it)")
    args = ap.parse_args()
    if args.prompt_shift is not None:
        return prompt_shift(args.prompt_shift)

    import pagedmoe

    torch.manual_seed(0)
    t0 = time.perf_counter()
    # dynamic precision, with a KV cache large enough that every expert starts exact
    llm = pagedmoe.LLM(device="cpu", dtype="float32", expert_precision="dynamic", num_kv_blocks=2048,
                       max_model_len=args.context)
    engine = llm.engine
    store = engine.expert_store
    L, E = len(engine.model.moe_layers()), engine.model.dims.num_experts
    keys = [(l, e) for l in range(L) for e in range(E)]
    assert set(engine.precision.assignment.values()) == {"bf16"}
    docs = load_documents(default_dataset())
    calib_docs, eval_docs = docs[:args.calib_files], docs[args.calib_files:]

    captured = capture_routed_inputs(engine, calib_docs, args.context, args.calib_tokens)
    rel, counts, energy = calibrate(store, captured, E, args.max_rows)
    del captured
    costs = QualityCosts.from_counts(rel, counts)
    # Variant: costs already carry the expert's weight in its layer (activity 1 each).
    energy_costs = QualityCosts(energy, {k: 1.0 for k in energy})
    # The runtime's ladder here: bf16 -> fp8 -> int8 -> int4 (its lossless rung needs bf16 weights; this runs float32).
    bpr = rung_bytes(store.hidden, store.inter, precisions=("bf16",) + LOSSY)
    bf16_total = bpr["bf16"] * len(keys)
    policy = PrecisionPolicy(bpr, costs)
    # Control: the same ladder and byte budget, experts ranked at random (no quality information), to
    # separate what the extra bytes buy from what the quality-aware ranking buys.
    gen = torch.Generator().manual_seed(0)
    random_costs = QualityCosts(rel, {k: torch.rand(1, generator=gen).item() for k in keys})
    print(f"calibrated in {time.perf_counter() - t0:.0f} s; bytes per expert {bpr}")

    runtime = Runtime(engine, bpr["bf16"])
    results = []

    def run(name, assignment, budget=None, rounds=None):
        t = time.perf_counter()
        r = evaluate(engine, eval_docs, args.context, args.eval_tokens, show_progress=False)
        mix = {p: sum(v == p for v in assignment.values()) for p in bpr}
        row = {"scheme": name, "budget": budget, "bytes_frac": policy.total_bytes(assignment) / bf16_total,
               "perplexity": r["perplexity"], "top1": r["top1_accuracy"], "tokens": r["tokens"],
               "model_cost": policy.total_cost(assignment), "mix": mix, "controller_rounds": rounds}
        results.append(row)
        print(f"{name:<14} budget {budget if budget is not None else '-':>5} bytes {row['bytes_frac']:.3f} "
              f"ppl {row['perplexity']:.4f} top1 {row['top1']:.4f} ({time.perf_counter() - t:.0f} s) {mix}",
              flush=True)
        return row

    runtime.reset(costs)
    run("bf16", {k: "bf16" for k in keys})
    for p in LOSSY:
        run(f"static-{p}", runtime.static(p))
    budgets = [float(b) for b in args.budgets.split(",")]
    extra = [float(b) for b in args.extra_budgets.split(",") if b]
    plans = {}
    for name, c, points in (("dynamic", costs, budgets + extra), ("dynamic-energy", energy_costs, budgets),
                            ("mixed-random", random_costs, budgets)):
        runtime.reset(c)
        # largest budget first: the controller only demotes here, like rising pressure
        for b in sorted(points, reverse=True):
            assignment, rounds = runtime.dynamic(int(b * bf16_total))
            if name == "dynamic":
                plans[b] = assignment
            run(name, assignment, b, rounds)
    runtime.reset(costs)

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
    out = {"runtime": "pagedmoe --expert-precision dynamic (DynamicExperts + DynamicPrecisionManager.demote_to)",
           "calibration": {"files": list(range(args.calib_files)), "tokens": args.calib_tokens,
                           "max_rows_per_expert": args.max_rows},
           "eval": {"first_file": args.calib_files, "tokens": by["bf16"]["tokens"], "context": args.context},
           "bytes_per_expert": bpr, "results": results, "table": table,
           "gap_closed_at": {"budget": b_lo, "dynamic": gap, "dynamic-energy": egap, "mixed-random": rgap},
           "calibration_counts": [[l, e, c] for (l, e), c in sorted(counts.items())],
           "quality_costs": costs.to_json(), "energy_costs": energy_costs.to_json(),
           "plans": {str(b): {f"{l},{e}": p for (l, e), p in plan.items()} for b, plan in plans.items()},
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
    ax.plot([100 * r["bytes_frac"] for r in dyn], [r["perplexity"] for r in dyn], "o-", label="dynamic (runtime)")
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



# -- prompt shift: code, then prose ------------------------------------------------------------------
PROSE = [
    "The old harbour town woke slowly. Fishermen carried their nets down to the water while the bakers "
    "opened their shutters, and the smell of fresh bread drifted along the narrow streets towards the sea.",
    "In the spring the river rose over its banks and flooded the meadows. The farmers waited for the water "
    "to recede, then ploughed the dark and heavy soil and planted barley, beans and a little wheat.",
    "She had never liked long train journeys, but this one was different. Through the window the hills "
    "turned from green to gold, and by evening the mountains stood against a sky the colour of copper.",
    "History remembers the treaty as a turning point, yet the people who signed it hardly noticed. They "
    "argued about the wording of a single clause for three days and went home tired and unsure.",
    "A good teacher listens more than she speaks. She asks a question, waits, and lets the silence do its "
    "work until a student finds the courage to answer in his own words.",
    "The museum was quiet on Monday mornings. Visitors wandered between the paintings, stopping now and "
    "then before a portrait whose eyes seemed to follow them across the room.",
    "Winter came early that year. Snow covered the roads before the harvest was in, and the village "
    "gathered in the church hall to share what food and firewood they had left.",
    "He wrote letters every week to his brother overseas, describing the weather, the neighbours and the "
    "small events of the town, though he rarely received an answer.",
]


def prompt_shift(path: Path, waves_per_phase: int = 3, per_wave: int = 8, prompt_len: int = 320,
                 max_tokens: int = 96) -> int:
    """Waves of long requests under a tight KV budget with --expert-precision dynamic: code prompts, then
    prose. Each wave fills the KV cache (the controller demotes), then drains (it promotes). Records the
    precision map and the activity EMA every step; plots one layer's map over time and, for all layers,
    the share of the current traffic (activity EMA) that exact experts serve."""
    import pagedmoe
    from pagedmoe import SamplingParams

    t0 = time.perf_counter()
    llm = pagedmoe.LLM(device="cpu", dtype="float32", expert_precision="dynamic", num_kv_blocks=480,
                       max_model_len=512, max_num_seqs=per_wave, max_num_batched_tokens=512,
                       kv_low_watermark=0.1, kv_high_watermark=0.4)
    e, tok = llm.engine, llm.engine.tokenizer
    code = [tok.encode(d)[:prompt_len] for d in load_documents(default_dataset())]
    prose_ids = tok.encode(" ".join(PROSE * 3))
    prose = [prose_ids[(97 * i) % (len(prose_ids) - prompt_len):][:prompt_len] for i in range(per_wave * 4)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    trace, phase_of_step, shift_step = [], [], None
    for phase, pool in (("code", code), ("prose", prose)):
        if phase == "prose":
            shift_step = len(trace)
        for w in range(waves_per_phase):
            for i in range(per_wave):
                e.add_request(f"{phase}-{w}-{i}", pool[(w * per_wave + i) % len(pool)], params)
            while e.has_unfinished_requests():
                e.step()
                ema, _ = e.activity.host_view()
                trace.append({"map": e.precision.precision_map(), "ema": ema,
                              "free": e.kv.num_free_blocks, "withheld": e.precision.withheld})
                phase_of_step.append(phase)
    stats = e.get_stats()
    rungs = ["bf16", "fp8", "int8", "int4"]
    L, E = len(trace[0]["map"]), len(trace[0]["map"][0])

    def exact_share(t):
        num = den = 0.0
        for l in range(L):
            for x in range(E):
                num += t["ema"][l][x] * (t["map"][l][x] == "bf16")
                den += t["ema"][l][x]
        return num / den if den else 0.0
    share = [exact_share(t) for t in trace]
    n_exact = [sum(p == "bf16" for row in t["map"] for p in row) for t in trace]
    # the layer whose activity moves most between the phases
    code_ema, prose_ema = trace[shift_step - 1]["ema"], trace[-1]["ema"]

    def moved(l):
        a, b = code_ema[l], prose_ema[l]
        sa, sb = sum(a) or 1.0, sum(b) or 1.0
        return sum(abs(x / sa - y / sb) for x, y in zip(a, b))
    layer = max(range(L), key=moved)
    order = sorted(range(E), key=lambda x: code_ema[layer][x] / (sum(code_ema[layer]) or 1)
                   - prose_ema[layer][x] / (sum(prose_ema[layer]) or 1))
    out = {"layer": layer, "shift_step": shift_step, "steps": len(trace), "expert_order": order,
           "exact_traffic_share": share, "num_exact": n_exact, "free_blocks": [t["free"] for t in trace],
           "maps_layer": [[t["map"][layer][x] for x in order] for t in trace],
           "num_preemptions": stats["num_preemptions_total"],
           "precision": {k: v for k, v in stats.items() if k.startswith("precision_")},
           "seconds": time.perf_counter() - t0}
    path.with_suffix(".json").write_text(json.dumps(out))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]},
                                   layout="constrained")
    grid = [[rungs.index(t["map"][layer][x]) for t in trace] for x in order]
    im = ax0.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis_r", vmin=0, vmax=3)
    cb = fig.colorbar(im, ax=[ax0, ax1], ticks=range(4), shrink=0.6, location="right")
    cb.ax.set_yticklabels(rungs)
    ax0.axvline(shift_step, color="red", lw=1.5)
    ax0.set_ylabel(f"MoE layer {layer}: experts\n(top: prose-heavy, bottom: code-heavy)")
    ax0.set_yticks([])
    ax0.set_title("dynamic expert precision while the prompt mix shifts from code to prose (red line)")
    ax1.plot(share, label="traffic (activity EMA) served by exact experts, all layers")
    ax1.plot([n / (L * E) for n in n_exact], label="share of experts exact")
    ax1.axvline(shift_step, color="red", lw=1.5)
    ax1.set_xlabel("engine step")
    ax1.set_ylim(0, 1.02)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8, loc="lower right")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"prompt shift: {len(trace)} steps, shift at {shift_step}, layer {layer}, preemptions "
          f"{out['num_preemptions']}, {out['precision']}, {out['seconds']:.0f} s")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
