#!/usr/bin/env bash
# Issue 23's GPU runs (the fused lossless GEMM), on one H200. One device call can take both parts (each cut at
# RUN_TIMEOUT):
#   tests  the hibyte kernel's GPU tests (torch.equal against decode-then-GEMM at the Mixtral and Qwen3 shapes, and
#          the exact=False candidate within bf16 tolerance), then the fused-compressed tier's          ~3 min
#   bench  benchmarks/bench_fused_lossless.py --no-v2-variants: one MoE layer with every expert compressed
#          against bf16-resident at 1 / 16 / 64 / 256 tokens, every hibyte row (the layer's tiles, 4 warps,
#          k4 = exact=False, m32 = MMA v2 at T >= 128), the encoders' rates                              ~5 min
# Results under $OUT/issue23/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
D=$OUT/issue23
RUN_TIMEOUT=${RUN_TIMEOUT:-400}
mkdir -p "$D"
t() { timeout --kill-after=15 "$RUN_TIMEOUT" "$@"; }

for part in "$@"; do
  SECONDS=0
  echo "=== $part"
  case $part in
    tests)
      t python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe_hibyte.py tests/models/test_fused_compressed.py \
        > "$D/tests.log" 2>&1
      tail -15 "$D/tests.log" ;;
    bench)
      t python3 benchmarks/bench_fused_lossless.py --no-v2-variants --out "$D" > "$D/bench_fused_lossless.log" 2>&1
      grep -E "encode|hibyte|wrote" "$D/bench_fused_lossless.log" | tail -120 ;;
    *) echo "unknown part $part (tests, bench)" >&2 ;;
  esac
  echo "=== $part took ${SECONDS} s"
done
