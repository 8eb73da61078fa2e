#!/usr/bin/env bash
# Issue 21's GPU figures on one H200 (dummy bf16 weights: uniform routing, so cache hits are a lower bound of
# what a real checkpoint's skewed routing gives). One part per device call (each < 10 min):
#   run(command="bash benchmarks/gpu_issue21.sh qwen")      Qwen3-30B-A3B at 24 GiB: decode at batch 1/8/32/64,
#                                                           --expert-fetch routed and stream, next to the floor
#   run(command="bash benchmarks/gpu_issue21.sh large")     the same at batch 32 and 64 only
#   run(command="bash benchmarks/gpu_issue21.sh mixtral")   Mixtral-8x7B at 24 GiB, batch 1, routed and stream
#   run(command="bash benchmarks/gpu_issue21.sh serve")     serving, Qwen3 at 60 GiB paged N=64, routed with the host
#                                                           tier raw and compressed: 64 prompts at once and 4 clients
#                                                           (TPOT against stream-all's 571 ms)
#   run(command="bash benchmarks/gpu_issue21.sh micro")     per-layer sync cost, copy-engine vs UVA gather
#   run(command="bash benchmarks/gpu_issue21.sh paths")     Qwen3 at 24 GiB routed: --expert-fetch-path uva (path (b),
#                                                           CUDA graphs) against copy (path (a), eager); the qwen
#                                                           part runs auto (the cost model's path per bucket)
#   run(command="bash benchmarks/gpu_issue21.sh uvac")      Qwen3 at 24 GiB routed, --expert-fetch-path uva (path (b), CUDA
#                                                           graphs) with the lossless tiers the placement search picks
#                                                           (default compression: the compressed GPU tier, and the host
#                                                           tier compressed, decoded from mapped host memory), sized
#                                                           for 8 sequences: batch 1 and 8 (target at 8: <= 222 ms/step);
#                                                           uvacraw: the same with --host-compression none
#   run(command="bash benchmarks/gpu_issue21.sh lossless")  Qwen3 at 24 GiB routed with the host tier compressed
#                                                           (--host-compression lossless: compressed bytes per miss)
#   run(command="bash benchmarks/gpu_issue21.sh placement") Qwen3 at 24 GiB, --expert-fetch auto with the engine sized
#                                                           for the batch (--max-num-seqs 1, 8): the placement the
#                                                           routed-aware search picks (planning/routed_plan.py), and
#                                                           the same with compression forbidden (bf16 N only)
# Results under $OUT: <part>-<fetch>.json (bench latency --output-json: per batch expert_bytes_moved_per_step,
# routed_expert_bytes_per_step), issue21-<part>.log with the floors (moved bytes / 54.5 GB/s PCIe).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
mkdir -p "$OUT"
PART=${1:?usage: gpu_issue21.sh qwen|large|prefetch|mixtral|serve|micro|paths|uvac|uvacraw|lossless|placement}
LOG="$OUT/issue21-$PART.log"
Q=benchmarks/configs/qwen3-30b-a3b
M=benchmarks/configs/mixtral-8x7b

latency() {  # name model limit_s fetch batches...
  local name=$1 model=$2 limit=$3 fetch=$4; shift 4
  echo "=== $name: $model --expert-fetch $fetch batches $*" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" python -m pagedmoe.cli bench latency "$model" --load-format dummy \
    --gpu-memory-gb 24 --expert-fetch "$fetch" --batch-size "$@" --input-len 128 --output-len 32 \
    --max-model-len 512 --max-num-seqs 64 ${EXTRA_FLAGS:-} --output-json "$OUT/$name-$fetch.json" 2>&1 \
    | tee "$OUT/$name-$fetch.out" | tail -20 | tee -a "$LOG"
  grep -h "placement for routed fetching\|placement plan:\|routed expert fetching\|INFO pagedmoe: loaded \|device memory after start-up" \
    "$OUT/$name-$fetch.out" | tee -a "$LOG"   # start-up: load time and its peak (before any step)
  python - "$OUT/$name-$fetch.json" <<'PY' 2>&1 | tee -a "$LOG"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    step = r["median_decode_step_ms"]
    print(f"batch {r['batch_size']}: {step:.1f} ms/step, {1e3 * r['batch_size'] / step:.1f} tok/s; moved "
          f"{r['expert_bytes_moved_per_step'] / 1e9:.3f} GB/step (PCIe floor {r['expert_bytes_moved_per_step'] / 54.5e6:.1f} ms), "
          f"routed {r['routed_expert_bytes_per_step'] / 1e9:.3f} GB/step (floor with no hits "
          f"{r['routed_expert_bytes_per_step'] / 54.5e6:.1f} ms), decoded {r.get('expert_bytes_decoded_per_step', 0) / 1e9:.3f} GB/step")
PY
}

case "$PART" in
  qwen)
    # stream-all's step does not depend on the batch (818 ms at batch 1, 8 and 32 at 449de78): batch 1 only
    latency qwen "$Q" 330 routed 1 8 32 64
    latency qwen "$Q" 150 stream 1 ;;
  large)
    # batch 32 and 64 alone (the qwen part's larger batches), sized for 64 sequences
    latency qwen-large "$Q" 250 routed 32 64 ;;
  prefetch)
    EXTRA_FLAGS="--expert-prefetch" latency qwen-prefetch "$Q" 190 routed 1 8 ;;
  mixtral)
    latency mixtral "$M" 280 routed 1
    latency mixtral "$M" 280 stream 1 ;;
  serve)
    # routed with the host tier raw and compressed (path (b) decodes it from mapped host memory), 64 prompts at
    # once and 4 clients; stream-all's row (571 ms TPOT) is docs/benchmarks.md's
    for host in none lossless; do
      BUDGET_GB=60 NUM_PROMPTS=64 bash benchmarks/bench_serve.sh "qwen60-n64-routed-host-$host" --expert-placement \
        paged --num-gpu-experts 64 --expert-fetch routed --host-compression "$host" 2>&1 | tail -25 | tee -a "$LOG"
    done
    BUDGET_GB=60 NUM_PROMPTS=16 MAX_CONCURRENCY=4 PORT=8001 bash benchmarks/bench_serve.sh \
      "qwen60-n64-routed-host-lossless-c4" --expert-placement paged --num-gpu-experts 64 --expert-fetch routed \
      --host-compression lossless 2>&1 | tail -25 | tee -a "$LOG" ;;
  micro)
    python benchmarks/bench_routed_fetch.py 2>&1 | tee -a "$LOG" ;;
  paths)
    EXTRA_FLAGS="--expert-fetch-path uva" latency qwen-uva "$Q" 280 routed 1 8 32
    EXTRA_FLAGS="--expert-fetch-path copy" latency qwen-copy "$Q" 280 routed 1 8 32 ;;
  uvac)
    EXTRA_FLAGS="--expert-fetch-path uva --max-num-seqs 8 --dtype bfloat16" latency qwen-uvac "$Q" 200 routed 1 8 ;;
  uvacraw)
    EXTRA_FLAGS="--expert-fetch-path uva --max-num-seqs 8 --dtype bfloat16 --host-compression none" \
      latency qwen-uvacraw "$Q" 200 routed 1 8 ;;
  lossless)
    EXTRA_FLAGS="--host-compression lossless --dtype bfloat16 --expert-fetch-path copy" \
      latency qwen-lossless "$Q" 280 routed 1 8 32 64
    EXTRA_FLAGS="--host-compression lossless --dtype bfloat16" latency qwen-lossless "$Q" 280 stream 1 8 ;;
  placement)
    for b in 1 8; do EXTRA_FLAGS="--max-num-seqs $b" latency "qwen-sized-b$b" "$Q" 280 auto "$b"; done
    EXTRA_FLAGS="--max-num-seqs 8 --expert-compression none --host-compression none" \
      latency qwen-sized-b8-nocompression "$Q" 200 auto 8 ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
