"""The pagedmoe-vs-vLLM table of benchmarks/vs_vllm.sh: parse each run's printed lines, write markdown + JSON.

    python benchmarks/vs_vllm_table.py DIR [DIR...] [--out PREFIX]

Each DIR holds the logs one or more `vs_vllm.sh` calls wrote, named MODEL.REGIME.ENGINE.log (REGIME: tput,
w4, pf, lat; ENGINE: vllm, or pagedmoe[-VARIANT]), beside MODEL.REGIME.ENGINE.json where the engine wrote one
and MODEL.meta.json (budgets). Parsed lines (the last match in a log wins; a run that printed none is listed
as failed, with its log's last line):
  vLLM and pagedmoe `bench throughput`:  Throughput: X requests/s, Y total tokens/s, Z output tokens/s
  vLLM `bench latency`:                  Avg latency: N seconds
  pagedmoe `bench latency`:              the JSON's request latency (wall, first step to last, as vLLM's
                                         generate()), else the printed "Batch 1: request latency L ms" line;
                                         from older runs without it, the JSON's prefill + every decode step,
                                         else the printed prefill and median decode step lines (P + N x M)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional

THROUGHPUT = re.compile(r"Throughput:\s*([\d.]+)\s*requests/s,\s*([\d.]+)\s*total tokens/s,\s*([\d.]+)\s*output tokens/s")
AVG_LATENCY = re.compile(r"Avg latency:\s*([\d.]+)\s*seconds")
PM_PREFILL = re.compile(r"Batch 1: prefill ([\d.]+) ms")
PM_DECODE = re.compile(r"Batch 1: decode step \(median of (\d+)\) ([\d.]+) ms")
PM_REQUEST = re.compile(r"Batch 1: request latency ([\d.]+) ms")
REGIMES = {"tput": "whole GPU, offline throughput (output tok/s)",
           "w4": "weights + 4 GiB, offline throughput (output tok/s)",
           "pf": "prefill, whole GPU, 1024 in / 1 out, offline throughput (total tok/s)",
           "lat": "batch 1, 512 in + 64 out, request latency (s)"}


def _last(pattern: re.Pattern, text: str) -> Optional[re.Match]:
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def parse_throughput(text: str) -> Optional[dict]:
    """The 'Throughput:' line vLLM and pagedmoe print (CONVENTIONS.md), else None."""
    m = _last(THROUGHPUT, text)
    if m is None:
        return None
    return {"requests_per_s": float(m[1]), "total_tokens_per_s": float(m[2]), "output_tokens_per_s": float(m[3])}


def parse_vllm_latency(text: str) -> Optional[dict]:
    m = _last(AVG_LATENCY, text)
    return None if m is None else {"latency_s": float(m[1])}


def parse_pagedmoe_latency(text: str, record: Optional[dict]) -> Optional[dict]:
    if record and record.get("results"):
        r = next((r for r in record["results"] if r.get("batch_size") == 1), record["results"][0])
        steps = r.get("decode_step_ms") or []
        latency = r.get("request_latency_s", r["prefill_time_s"] + sum(steps) / 1e3)
        return {"latency_s": latency, "median_decode_step_ms": r["median_decode_step_ms"],
                "decode_floor_ms": r.get("decode_floor_ms"), "decode_steps": len(steps)}
    p, d, req = _last(PM_PREFILL, text), _last(PM_DECODE, text), _last(PM_REQUEST, text)
    if d is None or (p is None and req is None):
        return None
    n, step = int(d[1]), float(d[2])
    latency = float(req[1]) / 1e3 if req is not None else (float(p[1]) + n * step) / 1e3
    return {"latency_s": latency, "median_decode_step_ms": step, "decode_steps": n}


def parse_run(log: Path) -> dict:
    """One run's result from its log (and JSON), with 'error' when its figure is missing."""
    model, regime, engine = log.name[:-len(".log")].split(".", 2)
    text = log.read_text(errors="replace")
    jpath = log.with_suffix(".json")
    record = None
    if jpath.exists():
        try:
            record = json.loads(jpath.read_text())
        except json.JSONDecodeError:
            record = None
    if regime == "lat":
        value = parse_vllm_latency(text) if engine == "vllm" else parse_pagedmoe_latency(text, record)
    else:
        value = parse_throughput(text)
    run = {"model": model, "regime": regime, "engine": engine, "log": str(log)}
    if value is None:
        tail = [line for line in text.splitlines() if line.strip()][-1:] or ["(empty log)"]
        run["error"] = tail[0][:200]
    else:
        run.update(value)
    return run


def figure(run: dict) -> Optional[float]:
    """The regime's figure: latency, prompt + output tokens/s for the prefill regime, else output tokens/s."""
    if run["regime"] == "lat":
        return run.get("latency_s")
    return run.get("total_tokens_per_s" if run["regime"] == "pf" else "output_tokens_per_s")


def collect(dirs: list[Path]) -> dict:
    runs, meta = {}, {}
    for d in dirs:
        for log in sorted(d.glob("*.*.*.log")):
            run = parse_run(log)
            runs[(run["model"], run["regime"], run["engine"])] = run  # a later folder's run wins
        for m in sorted(d.glob("*.meta.json")):
            meta[m.name[:-len(".meta.json")]] = json.loads(m.read_text())
    return {"runs": list(runs.values()), "meta": meta}


def rows(result: dict) -> list[dict]:
    """One row per (model, regime): vLLM's figure, each pagedmoe variant's, and each one's ratio over vLLM
    (> 1 = pagedmoe better: throughput over vLLM's, or vLLM's latency over pagedmoe's)."""
    table = {}
    for run in result["runs"]:
        table.setdefault((run["model"], run["regime"]), {})[run["engine"]] = run
    out = []
    order = list(REGIMES)
    for (model, regime) in sorted(table, key=lambda k: (k[0], order.index(k[1]) if k[1] in order else 99)):
        engines = table[(model, regime)]
        vllm = figure(engines["vllm"]) if "vllm" in engines else None
        ours = {}
        for name, run in sorted(engines.items()):
            if name == "vllm":
                continue
            f = figure(run)
            ratio = None
            if f and vllm:
                ratio = vllm / f if regime == "lat" else f / vllm
            ours[name] = {"value": f, "ratio_over_vllm": ratio, "error": run.get("error"),
                          **({"median_decode_step_ms": run["median_decode_step_ms"]}
                             if "median_decode_step_ms" in run else {})}
        out.append({"model": model, "regime": regime, "vllm": vllm,
                    "vllm_error": engines.get("vllm", {}).get("error"), "pagedmoe": ours,
                    "meta": result["meta"].get(model, {})})
    return out


def _fmt(v: Optional[float], regime: str) -> str:
    if v is None:
        return "—"
    return f"{v:.4f}" if regime == "lat" else f"{v:.1f}"


def markdown(table: list[dict]) -> str:
    lines = ["| model | regime | vLLM 0.24.0 | pagedmoe | ratio (> 1: pagedmoe ahead) |",
             "| --- | --- | --- | --- | --- |"]
    for r in table:
        regime = REGIMES.get(r["regime"], r["regime"])
        if r["regime"] == "w4" and r["meta"].get("w4_budget_gib"):
            regime += f" = {r['meta']['w4_budget_gib']:.2f} GiB, utilization {r['meta'].get('w4_utilization', 0):.4f}"
        vllm = _fmt(r["vllm"], r["regime"]) if r["vllm_error"] is None else f"failed: {r['vllm_error']}"
        cells, ratios = [], []
        for name, v in r["pagedmoe"].items():
            label = name.removeprefix("pagedmoe").lstrip("-") or "resident"
            if v["error"] is not None:
                cells.append(f"{label}: failed: {v['error']}")
                ratios.append(f"{label}: —")
                continue
            extra = f" ({v['median_decode_step_ms']:.2f} ms/step)" if "median_decode_step_ms" in v else ""
            cells.append(f"{label}: {_fmt(v['value'], r['regime'])}{extra}")
            ratios.append(f"{label}: {v['ratio_over_vllm']:.2f}x" if v["ratio_over_vllm"] else f"{label}: —")
        lines.append(f"| {r['model']} | {regime} | {vllm} | {'; '.join(cells) or '—'} | {'; '.join(ratios) or '—'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="pagedmoe vs vLLM table from vs_vllm.sh logs")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", default=None, help="write PREFIX.md and PREFIX.json (default: the first DIR/table)")
    args = p.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        print(f"error: not a folder: {', '.join(missing)}", file=sys.stderr)
        return 2
    result = collect(args.dirs)
    table = rows(result)
    md = markdown(table)
    prefix = Path(args.out) if args.out else args.dirs[0] / "table"
    prefix.with_suffix(".md").write_text(md)
    prefix.with_suffix(".json").write_text(json.dumps({"rows": table, **result}, indent=1))
    print(md, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
