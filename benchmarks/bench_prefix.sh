#!/usr/bin/env bash
# Prefix caching on the GPU machine: `bench serve` with one shared system prompt (PREFIX_LEN tokens, then
# INPUT_LEN tokens of each request's own), resident and paged, prefix caching on and off; one table of
# TTFT and throughput at the end. Each of the four runs is benchmarks/bench_serve.sh (start `pagedmoe serve`
# with dummy weights at BUDGET_GB, bench, SIGTERM), results under $OUT.
#
#   bash benchmarks/bench_prefix.sh
#
# Environment (defaults in brackets): MODEL [benchmarks/configs/qwen3-30b-a3b], BUDGET_GB [60],
# PREFIX_LEN [2000], INPUT_LEN [100], OUTPUT_LEN [32], NUM_PROMPTS [64], MAX_CONCURRENCY [64],
# REQUEST_RATE [inf], MAX_MODEL_LEN [4096], PLACEMENTS ["resident paged"], RESIDENT_FLAGS
# [--expert-placement resident], PAGED_FLAGS [--expert-placement paged --num-gpu-experts 96],
# SERVE_FLAGS [--max-num-seqs 64: extra flags for every run], OUT [./out], PYTHON [python].
# About 4 x (start-up + 20-40 s) on one H200 with the defaults.
set -euo pipefail

export PREFIX_LEN=${PREFIX_LEN:-2000}
export INPUT_LEN=${INPUT_LEN:-100}
export OUTPUT_LEN=${OUTPUT_LEN:-32}
export NUM_PROMPTS=${NUM_PROMPTS:-64}
export MAX_CONCURRENCY=${MAX_CONCURRENCY:-64}
export OUT=${OUT:-./out}
PYTHON=${PYTHON:-python}
PLACEMENTS=${PLACEMENTS:-resident paged}
RESIDENT_FLAGS=${RESIDENT_FLAGS:---expert-placement resident}
PAGED_FLAGS=${PAGED_FLAGS:---expert-placement paged --num-gpu-experts 96}
SERVE_FLAGS=${SERVE_FLAGS:---max-num-seqs 64}
HERE=$(dirname "$0")
mkdir -p "$OUT"

LABELS=()
for placement in $PLACEMENTS; do
    case $placement in
        resident) flags=$RESIDENT_FLAGS ;;
        paged) flags=$PAGED_FLAGS ;;
        *) echo "unknown placement $placement (resident or paged)"; exit 2 ;;
    esac
    for caching in on off; do
        label=prefix-$placement-$caching
        cache_flag=--enable-prefix-caching
        [ "$caching" = off ] && cache_flag=--no-enable-prefix-caching
        # shellcheck disable=SC2086  # the flag strings are word lists on purpose
        bash "$HERE/bench_serve.sh" "$label" $flags $SERVE_FLAGS $cache_flag
        LABELS+=("$label")
    done
done

"$PYTHON" - "$OUT" "${LABELS[@]}" <<'PY'
import json, re, sys
from pathlib import Path

out, labels = Path(sys.argv[1]), sys.argv[2:]
cols = ("run", "prefix cache", "mean TTFT ms", "median TTFT ms", "p99 TTFT ms", "output tok/s", "total tok/s",
        "req/s", "cache hit %")
rows = []
for label in labels:
    r = json.loads((out / f"serve-{label}.json").read_text())
    text = (out / f"metrics-{label}.txt").read_text()

    def metric(name):
        m = re.search(rf"^pagedmoe:{name}\{{[^}}]*\}} (\S+)", text, re.M)
        return float(m.group(1)) if m else 0.0

    queries = metric("prefix_cache_queries_total")
    hit = 100 * metric("prefix_cache_hits_total") / queries if queries else 0.0
    placement, caching = label.split("-")[1:3]
    rows.append((placement, caching, f"{r['mean_ttft_ms']:.1f}", f"{r['median_ttft_ms']:.1f}",
                 f"{r['p99_ttft_ms']:.1f}", f"{r['output_throughput']:.1f}", f"{r['total_token_throughput']:.1f}",
                 f"{r['request_throughput']:.2f}", f"{hit:.1f}"))
widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
print(f"\nshared prefix {r['config']['random_prefix_len']} tokens + {r['config']['random_input_len']} own, "
      f"{r['config']['random_output_len']} out, {r['num_prompts']} requests, concurrency {r['max_concurrency']}")
for row in (cols, *rows):
    print("  ".join(v.rjust(w) for v, w in zip(row, widths)))
PY
