#!/usr/bin/env bash
# Issue 5's GPU table on one H200: Mixtral-8x7B and Qwen3-30B-A3B shapes (dummy bf16), 1024 in / 1024 out,
# resident where it fits, paged where resident cannot load and at weights + 4 GiB (the headline ratio).
# Every point is a steady-state measurement (`bench sweep --steady-decode-steps 64`: the KV cache filled
# with as many sequences as the workload keeps in flight, 64 decode steps timed with the cache full, then 8
# eager steps timing the pager's copies with CUDA events; the full run projected from them).
# 8192 batched tokens (MAX_BATCHED): at 16384 the prefill activations (4.25 GiB) leave resident Mixtral no
# room at weights + 4 GiB.
# The points are split in parts that each fit one 10-minute device call:
#   run(command="COMMIT=<local HEAD> bash benchmarks/gpu_issue5.sh a")   # then b, c
# Results: $OUT/<point>.json (bench sweep's sweep.json), $OUT/issue5-<part>.log; merge them on the CPU with
#   pagedmoe bench sweep --replot <the json files> --output-dir DIR
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
WORK=${WORK:-/tmp/issue5}
M=benchmarks/configs/mixtral-8x7b
Q=benchmarks/configs/qwen3-30b-a3b
mkdir -p "$OUT" "$WORK"
LOG="$OUT/issue5-${1:-a}.log"

point() {  # name model timeout_s budgets... -- placements...   (env EXTRA: more engine flags)
  local name=$1 model=$2 limit=$3; shift 3
  local budgets=() placements=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do budgets+=("$1"); shift; done
  shift
  placements=("$@")
  echo "=== $name: $model budgets ${budgets[*]} placements ${placements[*]} (limit ${limit} s)" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" python -m pagedmoe.cli bench sweep "$model" --load-format dummy \
    --budgets "${budgets[@]}" --placements "${placements[@]}" --num-prompts 256 --input-len 1024 --output-len 1024 \
    --steady-decode-steps 64 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens "${MAX_BATCHED:-8192}" \
    ${EXTRA:-} --no-plots --output-dir "$WORK/$name" > "$WORK/$name.log" 2>&1
  echo "exit $?" | tee -a "$LOG"
  grep -E "^\[sweep\]|Error|error" "$WORK/$name.log" | tail -8 | tee -a "$LOG"
  sed -n '/^budget GiB/,/^wrote/p' "$WORK/$name.log" | tee -a "$LOG"
  [ -f "$WORK/$name/sweep.json" ] && cp "$WORK/$name/sweep.json" "$OUT/$name.json"
}

{
  echo "date: $(date -u +%FT%TZ) commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$LOG"

case ${1:-a} in
  a)  # Mixtral at 24 GiB: resident cannot load, every expert streams over PCIe (~1.7 s a step)
    point mixtral-24 $M 290 24 -- paged ;;
  b)  # Mixtral at 64 GiB (paged: resident cannot load), weights + 4 (resident vs paged) and 139 (resident)
    point mixtral-64 $M 290 64 -- paged
    point mixtral-w4 $M 170 weights+4 -- resident paged
    point mixtral-139 $M 110 139 -- resident ;;
  c)  # Qwen3: 24 GiB (paged), 64 GiB and weights + 4 (resident vs paged), 139 GiB (resident)
    point qwen3-24 $Q 170 24 -- paged
    point qwen3-64 $Q 150 64 -- resident paged
    point qwen3-w4 $Q 150 weights+4 -- resident paged
    point qwen3-139 $Q 100 139 -- resident ;;
  d)  # one call for the points that matter most (the order puts the longest last)
    point mixtral-w4 $M 150 weights+4 -- resident paged
    point mixtral-139 $M 90 139 -- resident
    point qwen3-w4 $Q 120 weights+4 -- resident paged
    point qwen3-139 $Q 80 139 -- resident
    point qwen3-24 $Q 150 24 -- paged ;;
  e)  # what part d could not finish
    point mixtral-139 $M 90 139 -- resident
    point qwen3-w4p $Q 180 weights+4 -- paged ;;
  f)  # issue 6 end to end: Mixtral at 64 GiB and weights + 4 with the compressed host tier, and the ring buffers
    point mixtral-64-host-lossless $M 290 64 -- paged+host-lossless
    EXTRA="--expert-buffers vmm-ring" point mixtral-w4-ring $M 150 weights+4 -- paged ;;
  g)  # issue 6 end to end, the lossless GPU tier where the planner picks it: every Mixtral expert compressed at
      # weights + 4 (modelled 1158 output tok/s against resident's 256), Qwen3 C=123 at weights + 4 and 64 GiB
      # (modelled 1721 / 1963 against resident's 658 / 1184)
    point mixtral-w4-lossless $M 170 weights+4 -- paged+lossless
    point qwen3-w4-lossless $Q 170 weights+4 -- paged+lossless
    point qwen3-64-lossless $Q 200 64 -- resident paged+lossless ;;
  *) echo "usage: gpu_issue5.sh a|b|c|d|e|f|g"; exit 2 ;;
esac
