"""Issue 19: budget vs the process's peak device memory vs throughput, on the GPU machine.

    python benchmarks/memory_bound.py a --out $OUT      # device call 1: Mixtral-8x7B at weights + 4 GiB, 64 GiB (part)
    python benchmarks/memory_bound.py b --out $OUT      # device call 2: Mixtral-8x7B at 64 GiB (rest), Qwen3 at 24 GiB
    python benchmarks/memory_bound.py table DIR [DIR] --out OUT   # CPU: the table of the parts' sweep.json files

Each stage is one `pagedmoe bench sweep` over the placements that fit at that budget (resident does not at
64 / 24 GiB), on the sweeps' workload (1024 in / 1024 out, max_model_len 2048, 8192 batched tokens, steady
state with the KV cache full, random bf16 weights) with a short window (--steady-decode-steps 16). Every
point records the process's device memory (`device_memory`: the driver's count, polled from engine start to
the end of the run) beside its budget. A part stops starting stages --part-budget-s after it began (each
sweep is cut at that deadline too, keeping the points it finished). Writes OUT/<stage>/sweep.json and
sweep.log, then OUT/memory_bound.json and the table (peak / budget, throughput against docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "benchmarks" / "configs"
ALL = ["resident", "paged", "paged+lossless", "paged+host-lossless", "static-int4", "dynamic"]
NOT_RESIDENT = [p for p in ALL if p != "resident"]
# (stage, model folder, budget, placements); estimates from the 88b5abf / d234426 runs at 16 steady steps
# (load + fill + 16 + 8 steps per point: ~8.5 + ~9.5 minutes; the PCIe-bound paged points dominate)
PARTS = {
    "a": [("mixtral-w4", "mixtral-8x7b", "weights+4", ALL),                                       # ~5.5 min
          ("mixtral-64-a", "mixtral-8x7b", "64", ["paged+lossless", "static-int4", "dynamic"])],  # ~3 min
    "b": [("mixtral-64-b", "mixtral-8x7b", "64", ["paged", "paged+host-lossless"]),               # ~3.5 min
          ("qwen3-24", "qwen3-30b-a3b", "24", NOT_RESIDENT)],                                     # ~6 min
}
# Throughput of the same point in docs/benchmarks.md (88b5abf exact placements, d234426 dynamic; 32 steps)
DOCS_TOK_S = {
    ("mixtral-8x7b", "weights+4", "resident"): 255.13, ("mixtral-8x7b", "weights+4", "paged"): 219.63,
    ("mixtral-8x7b", "weights+4", "paged+lossless"): 919.25, ("mixtral-8x7b", "weights+4", "dynamic"): 1482.91,
    ("mixtral-8x7b", "64", "paged"): 126.25, ("mixtral-8x7b", "64", "paged+host-lossless"): 169.50,
    ("mixtral-8x7b", "64", "dynamic"): 1307.46,
    ("qwen3-30b-a3b", "24", "paged"): 81.22, ("qwen3-30b-a3b", "24", "paged+host-lossless"): 108.42,
}
WORKLOAD = ["--load-format", "dummy", "--input-len", "1024", "--output-len", "1024",
            "--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--no-plots"]


def run_part(part: str, out: Path, budget_s: float, steps: int, num_prompts: int = 256) -> int:
    deadline = time.monotonic() + budget_s
    rc = 0
    for stage, model, budget, placements in PARTS[part]:
        left = deadline - time.monotonic()
        if left < 60:
            print(f"=== {stage}: skipped, {left:.0f} s left of the part's budget", flush=True)
            rc = rc or 124
            continue
        d = out / stage
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pagedmoe.cli", "bench", "sweep", str(CONFIGS / model), "--budgets", budget,
               "--placements", *placements, "--steady-decode-steps", str(steps), "--num-prompts", str(num_prompts),
               *WORKLOAD, "--output-dir", str(d)]
        print(f"=== {stage}: {' '.join(cmd[3:])} (cut at {left:.0f} s)", flush=True)
        t0 = time.monotonic()
        with open(d / "sweep.log", "w") as log:
            try:
                # this checkout's pagedmoe, installed or not
                path = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
                r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=left - 5,
                                   env={**os.environ, "PAGEDMOE_NO_PROGRESS": "1", "PYTHONPATH": path})
                code = r.returncode
            except subprocess.TimeoutExpired:
                code = 124
        print(f"=== {stage}: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
        for line in (d / "sweep.log").read_text().splitlines():
            if line.startswith("[sweep]") or "device memory" in line:
                print("   ", line)
        rc = rc or code
    print(table([out]))
    return rc


def collect(dirs: list[Path]) -> list[dict]:
    rows = []
    for d in dirs:
        for path in sorted(Path(d).rglob("sweep.json")):
            data = json.loads(path.read_text())
            for p in data["points"]:
                mem = p.get("device_memory") or {}
                tok = p.get("output_tokens_per_second")
                docs = DOCS_TOK_S.get((p.get("model"), p.get("budget_arg"), p["placement"]))
                rows.append({"model": p.get("model"), "budget": p.get("budget_arg"), "budget_gib": p["budget_gib"],
                             "placement": p["placement"], "status": p["status"],
                             "needs_gib": p.get("needs_gib"), "message": p.get("message"),
                             "peak_gib": mem.get("peak_gib"), "used_at_end_gib": mem.get("used_gib"),
                             "torch_peak_reserved_gib": mem.get("torch_peak_reserved_gib"),
                             "peak_over_budget": mem.get("peak_over_budget"), "stages_gib": mem.get("stages_gib"),
                             "output_tokens_per_second": tok, "docs_tokens_per_second": docs,
                             "vs_docs": tok / docs if tok and docs else None, "seqs": p.get("num_requests"),
                             "kv_capacity_tokens": p.get("kv_capacity_tokens"), "commit": data.get("git_commit"),
                             "file": str(path)})
    return rows


def table(dirs: list[Path]) -> str:
    rows = collect(dirs)
    head = (f"{'model':<14}{'budget':>10}{'GiB':>8}  {'placement':<20}{'peak GiB':>9}{'peak/budget':>12}"
            f"{'out tok/s':>11}{'docs':>9}{'vs docs':>8}{'seqs':>6}")
    lines = [head, "-" * len(head)]
    worst = 0.0
    for r in rows:
        lead = f"{str(r['model']):<14}{str(r['budget']):>10}{r['budget_gib']:>8.2f}  {r['placement']:<20}"
        if r["status"] != "ok":
            why = f"does not fit (needs {r['needs_gib']:.2f} GiB)" if r["needs_gib"] else f"{r['status']}: {r['message']}"
            lines.append(lead + why[:90])
            continue
        ratio = r["peak_over_budget"]
        worst = max(worst, ratio or 0.0)
        f = lambda v, spec: format(v, spec) if v is not None else "-"  # noqa: E731
        lines.append(lead + f"{f(r['peak_gib'], '9.2f'):>9}{f(ratio, '12.3f'):>12}"
                     f"{f(r['output_tokens_per_second'], '11.2f'):>11}{f(r['docs_tokens_per_second'], '9.2f'):>9}"
                     f"{f(r['vs_docs'], '8.2f'):>8}{r['seqs']:>6}")
    lines.append(f"worst peak/budget {worst:.3f} (the bound: <= 1.02)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["a", "b", "table"])
    ap.add_argument("dirs", nargs="*", type=Path, help="table: folders holding the parts' sweep.json files")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "memory-bound-out")))
    ap.add_argument("--part-budget-s", type=float, default=570, help="stop starting (and cut) sweeps after this")
    ap.add_argument("--steady-decode-steps", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=256,
                    help="sequences at most (256: the docs' points; fewer fill faster, but throughput is then not "
                         "comparable with them; the exact placements' memory does not depend on it)")
    args = ap.parse_args()
    if args.part == "table":
        dirs = args.dirs or [args.out]
        print(table(dirs))
        args.out.mkdir(parents=True, exist_ok=True)
        out = args.out / "memory_bound.json"
        out.write_text(json.dumps({"rows": collect(dirs)}, indent=2) + "\n")
        print(f"wrote {out}")
        return 0
    rc = run_part(args.part, args.out, args.part_budget_s, args.steady_decode_steps, args.num_prompts)
    (args.out / f"memory_bound_{args.part}.json").write_text(json.dumps({"rows": collect([args.out])}, indent=2) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
