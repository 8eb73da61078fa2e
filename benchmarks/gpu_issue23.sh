#!/usr/bin/env bash
# Issue 23's GPU runs (the fused lossless GEMM), on one H200. One device call can take tests + bench, or w4p alone
# (tests and bench cut at RUN_TIMEOUT, each w4p run at W4P_TIMEOUT):
#   tests  the hibyte kernel's GPU tests at the Mixtral and Qwen3 shapes against decode-then-GEMM (halves and the
#          engine's exact tier torch.equal; the joined kernel and the engine's fast tier, tm-k4-warps4, against a
#          float32 reference as the bench checks k4), then the fused-compressed tiers' model tests (fused and
#          fused-hibyte-exact: logits equal to the decoding path's; fused-hibyte: within 5e-2, same tokens)  ~4 min
#   bench  benchmarks/bench_fused_lossless.py --no-v2-variants: one MoE layer with every expert compressed
#          against bf16-resident at 1 / 16 / 64 / 256 tokens, every hibyte row (the layer's tiles, 4 warps,
#          k4 = exact=False, m32 = MMA v2 at T >= 128, tm = tile_major bytes, tm-halves = the exact tier),
#          the encoders' rates                                                                           ~5 min
#   prefill benchmarks/bench_fused_prefill.py: the fused-hibyte tier at 512 / 2048 / 8192 tokens (in the GEMM's tile
#          loads, decoded a chunk at a time then the bf16 kernel, larger tiles) against bf16 grouped and Triton ~4 min
#   w4p    Qwen3-30B-A3B (benchmarks/configs, --load-format dummy) at weights + 4 GiB, paged + lossless (the planner's
#          split; vs_vllm.sh's w4p workload: 96 random prompts, 1024 in / 1024 out): the compressed GPU tier read by
#          the fused-hibyte GEMM (W4P_GEMMS, default "fused-hibyte decode"), then the decoding tier          ~8 min
# Results under $OUT/issue23/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
D=$OUT/issue23
RUN_TIMEOUT=${RUN_TIMEOUT:-400}
W4P_TIMEOUT=${W4P_TIMEOUT:-250}  # two runs + start-up in one 10-minute call
W4P_MODEL=${W4P_MODEL:-benchmarks/configs/qwen3-30b-a3b} W4P_PROMPTS=${W4P_PROMPTS:-96} W4P_LEN=${W4P_LEN:-1024}
read -r -a PM_EXTRA <<< "${PM_EXTRA:-}"  # a CPU dry run: --device cpu, smaller --max-model-len ...
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
    prefill)
      t python3 benchmarks/bench_fused_prefill.py > "$D/bench_fused_prefill.log" 2>&1
      echo "rc $?"
      grep -v -E "^Traceback|^  File|^    " "$D/bench_fused_prefill.log" | tail -100 ;;
    w4p)
      # the budget as vs_vllm.sh's: the bf16 weights the planner counts + 4 GiB (W4P_GIB overrides)
      gib=${W4P_GIB:-$(python3 -c "import sys; from pagedmoe.planning.model_shape import ModelShape; \
print(round(ModelShape.from_hf_config(sys.argv[1]).weight_bytes / 2**30 + 4, 2))" "$W4P_MODEL")}
      for gemm in ${W4P_GEMMS:-fused-hibyte decode}; do
        echo "--- w4p $gemm (--gpu-memory-gb $gib)"
        timeout --kill-after=15 "$W4P_TIMEOUT" python3 -m pagedmoe.cli bench throughput "$W4P_MODEL" \
          --load-format dummy --max-model-len 3072 --max-num-seqs 256 --max-num-batched-tokens 8192 \
          --num-prompts "$W4P_PROMPTS" --input-len "$W4P_LEN" --output-len "$W4P_LEN" \
          --expert-placement paged --expert-compression lossless \
          --compressed-gemm "$gemm" --gpu-memory-gb "$gib" "${PM_EXTRA[@]}" --output-json "$D/w4p-$gemm.json" \
          > "$D/w4p-$gemm.log" 2>&1
        echo "rc $?"
        grep -m2 -E "budget|experts:" "$D/w4p-$gemm.log"  # the planner's split: KV cache, compressed tier
        tail -3 "$D/w4p-$gemm.log"
      done ;;
    *) echo "unknown part $part (tests, bench, prefill, w4p)" >&2 ;;
  esac
  echo "=== $part took ${SECONDS} s"
done
