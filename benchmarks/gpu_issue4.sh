#!/usr/bin/env bash
# GPU fast path (issue 4) in one device call (< 10 min): GPU tests (engine, paging, fused MoE),
# fused-MoE kernel bench, lossless codec bench, Mixtral decode step vs HBM floor at B = 1/16/64/256,
# offline throughput 1024 x (512 in / 512 out) for Mixtral-8x7B and Qwen3-30B-A3B shapes.
# Results under $OUT; a summary prints last. Knobs: SKIP_TESTS, SKIP_KERNEL_BENCH, SKIP_CODEC, SKIP_LATENCY,
# THROUGHPUT_MODELS (" ": none), NUM_PROMPTS, MOE_BACKEND, TEST_TIMEOUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
export COMMIT=$(git rev-parse HEAD 2>/dev/null || echo "${COMMIT:-unknown}")
S="$OUT/summary.txt"; echo "commit $COMMIT" | tee "$S"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$S"
M=benchmarks/configs/mixtral-8x7b
Q=benchmarks/configs/qwen3-30b-a3b
MOE=${MOE_BACKEND:-auto}

if [ -z "${SKIP_TESTS:-}" ]; then  # run_all.sh's gputests stage runs every GPU test
  timeout ${TEST_TIMEOUT:-200} python -m pytest -q -n 8 -m gpu tests/models/test_gpu_engine.py \
    tests/models/test_gpu_paging.py tests/kernels/test_fused_moe.py > "$OUT/pytest_gpu.txt" 2>&1
  tail -4 "$OUT/pytest_gpu.txt" | tee -a "$S"
  if grep -q "failed" "$OUT/pytest_gpu.txt"; then grep -E "^FAILED" "$OUT/pytest_gpu.txt" | head -20 | tee -a "$S"; fi
fi
if [ -z "${SKIP_KERNEL_BENCH:-}" ]; then
  FUSED_MOE_MAX_S=${FUSED_MOE_MAX_S:-50} timeout 150 python benchmarks/bench_fused_moe.py > "$OUT/bench_fused_moe.log" 2>&1
  tail -22 "$OUT/bench_fused_moe.log" | tee -a "$S"
  if [ -z "${SKIP_CODEC:-}" ]; then  # run_all.sh's codec stage runs the full codec bench
    timeout 90 python benchmarks/bench_codec.py --quick --out "$OUT" > "$OUT/bench_codec.log" 2>&1
    tail -12 "$OUT/bench_codec.log" | tee -a "$S"
  fi
fi
LATENCY_BACKENDS=$MOE; [ -n "${SKIP_LATENCY:-}" ] && LATENCY_BACKENDS=""
for BACKEND in $LATENCY_BACKENDS; do
  timeout 150 python -m pagedmoe.cli bench latency $M --load-format dummy --batch-size 1 16 64 256 \
    --input-len 1024 --output-len 16 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384 \
    --expert-placement resident --moe-backend $BACKEND --output-json "$OUT/latency_mixtral_$BACKEND.json" 2>&1 \
    | grep -E "^Batch|rror" | sed "s/^/[$BACKEND] /" | tee -a "$S"
done
# Throughput with whichever expert backend had the faster batch-64 decode step above (auto without them).
BEST=$(python - "$OUT" $MOE <<'PY'
import json, sys
out, backends = sys.argv[1], sys.argv[2:]
best = (float("inf"), "auto")
for b in backends:
    try:
        rs = json.load(open(f"{out}/latency_mixtral_{b}.json"))["results"]
        best = min(best, (next(r["median_decode_step_ms"] for r in rs if r["batch_size"] == 64), b))
    except Exception:
        pass
print(best[1])
PY
)
echo "throughput expert backend: $BEST" | tee -a "$S"
for MODEL in ${THROUGHPUT_MODELS:-$M $Q}; do
  timeout 200 python -m pagedmoe.cli bench throughput $MODEL --load-format dummy --num-prompts ${NUM_PROMPTS:-1024} \
    --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 16384 \
    --expert-placement resident --moe-backend $BEST --output-json "$OUT/throughput_$(basename $MODEL).json" 2>&1 \
    | grep -E "Throughput:|rror" | sed "s/^/[$(basename $MODEL)] /" | tee -a "$S"
done
echo "=== summary ==="; cat "$S"
