#!/usr/bin/env bash
# Issue 25's GPU figures that are not side by side with vLLM (benchmarks/vs_vllm.sh runs those), on one H200.
# One device call can take several parts (each is cut at RUN_TIMEOUT):
#   tests   the GPU tests of the resident step's recent changes (fused q/k/v, the shared logits buffer across the
#           decode buckets, the counting router, pinned step inputs, async scheduling)        ~2.5 min
#   gemm    benchmarks/bench_small_gemm.py: the backbone's linears at M = 1..16, torch against kernels/small_gemm.py
#   prof    benchmarks/profile_step.py, Qwen3-30B-A3B resident, fused ops on, batch 1 and 256, with
#           --async-scheduling; then batch 1 with --backbone-gemm triton                        ~2 min
#   prefill profile_step.py --prefill: 8 prompts x 1024 tokens a step (8192), Qwen3-30B-A3B and Mixtral-8x7B,
#           by kernel class against the compute floor (issue 25 item 3: >= 0.7 of it)             ~2 min
#   prefill-stages  tune_prefill_attention.py --quick (ours against torch's cuDNN / flash attention) and
#           bench_prefill_moe.py on Qwen3-30B-A3B (the grouped MoE by stage, the Triton path beside it)  ~3 min
#   prefill-variants  Qwen3's 8192-token prefill step as it is, with our Triton prefill attention instead of cuDNN's,
#           with the Triton fused MoE at 8192 tokens, and replayed from a prefill CUDA graph  ~5 min
#   tune-attn  benchmarks/tune_prefill_attention.py: the prefill attention tiles, lazy rescale against eager  ~3 min
#   tune    benchmarks/tune_fused_moe.py for both shapes (fused_moe tiles per batch; --max-s per shape)  ~8 min
#   tune-mixtral  tune_fused_moe.py for Mixtral-8x7B at 256 and 128 tokens (TUNE_BATCHES, block_m TUNE_BLOCK_M),
#           kernels launched with PDL as the engine launches them, added to the shipped table (--resume); then
#           profile_step.py at batch 256 (PROF_BATCHES) with the shipped table and with the tuned one  ~7 min
#   gtests  the GPU tests of the activity counting under padded graph replays (prefill graphs against eager,
#           the counting router) and of the engines that replay graphs                          ~3 min
#   before  profile_step.py at batch 1 without this session's decode changes (PAGEDMOE_PDL=0, no tuned fused-MoE
#           table): Qwen3-30B-A3B and Mixtral-8x7B; then Qwen3 with the table but PDL off (PDL's own share)  ~3 min
#   pgraphs the prefill CUDA graphs (--prefill-graph-tokens): their GPU tests and those of the tests they touch
#           (engine, paging and routed-fetch references, fused MoE with SLOT_BLOCKS, PDL); then profile_step.py
#           --prefill of one 512-token prompt a step, both shapes, the graphs' wall against the same steps eager  ~6 min
# Results under $OUT/issue25/.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
D=$OUT/issue25
RUN_TIMEOUT=${RUN_TIMEOUT:-300}
mkdir -p "$D"
Q=benchmarks/configs/qwen3-30b-a3b
PROF=(--load-format dummy --expert-placement resident --input-len 512 --max-model-len 2048 --fused-ops on --num-steps 10)
t() { timeout --kill-after=15 "$RUN_TIMEOUT" "$@"; }

for part in "$@"; do
  SECONDS=0
  echo "=== $part"
  case $part in
    tests)
      t python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_host_copy.py tests/e2e/test_async_scheduling.py \
        tests/models/test_fused_ops_model.py tests/models/test_backbone_gemm_model.py tests/models/test_gpu_engine.py \
        tests/kernels/test_fused_ops.py tests/models/test_routed_stream_steps.py tests/unit/test_grouped_mm_chunks.py \
        tests/kernels/test_pdl.py tests/kernels/test_small_gemm.py tests/models/test_fused_compressed.py \
        tests/kernels/test_fused_moe.py tests/kernels/test_paged_attention.py tests/models/test_dynamic_precision.py \
        -k "not variants" > "$D/tests.log" 2>&1
      tail -15 "$D/tests.log" ;;
    gemm)
      t python3 benchmarks/bench_small_gemm.py --out "$D/bench_small_gemm.json" --max-s 60 > "$D/gemm.log" 2>&1
      tail -30 "$D/gemm.log" ;;
    prof)
      t python3 benchmarks/profile_step.py "$Q" "${PROF[@]}" --batch-size 1 256 --async-scheduling \
        --out "$D/prof-async" > "$D/prof-async.txt" 2>&1
      grep -A14 "=== batch" "$D/prof-async.txt" | head -36
      t python3 benchmarks/profile_step.py "$Q" "${PROF[@]}" --batch-size 1 --backbone-gemm triton \
        --out "$D/prof-triton" > "$D/prof-triton.txt" 2>&1
      grep -A14 "=== batch" "$D/prof-triton.txt" | head -18 ;;
    prefill)
      # Mixtral-8x7B resident (87 GiB of bf16 weights) needs an H200; an H100 (78 GiB) profiles Qwen3 only
      mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
      models=("$Q"); [ "${mib:-0}" -gt 100000 ] && models+=(benchmarks/configs/mixtral-8x7b)
      for m in "${models[@]}"; do
        t python3 benchmarks/profile_step.py "$m" --load-format dummy --expert-placement resident --prefill \
          --input-len 1024 --max-model-len 2048 --num-steps 5 --out "$D/prefill-$(basename "$m")" \
          > "$D/prefill-$(basename "$m").txt" 2>&1
        grep -A14 "=== prefill" "$D/prefill-$(basename "$m").txt" | head -16
      done ;;
    prefill-stages)
      # where the Qwen3 8192-token prefill's non-GEMM time goes: the attention against torch's cuDNN / flash
      # kernels (quick: our auto and best tiles only) and the grouped MoE by stage with the Triton path beside it
      t env OUT="$D" python3 benchmarks/tune_prefill_attention.py --quick > "$D/tune_prefill_attention.log" 2>&1
      grep -E "===|auto|m128|torch|best" "$D/tune_prefill_attention.log" | head -24
      t env OUT="$D" python3 benchmarks/bench_prefill_moe.py --shapes qwen3-30b-a3b > "$D/bench_prefill_moe.log" 2>&1
      cat "$D/bench_prefill_moe.log" | head -60 ;;
    prefill-variants)
      # Qwen3's 8192-token prefill step (profile_step.py --prefill) as it is (PAGEDMOE_PREFILL_ATTENTION=auto: cuDNN's
      # dense attention on a Hopper GPU) and with each candidate switched on: our Triton prefill attention (the
      # default before session33), the Triton fused MoE at 8192 tokens (PAGEDMOE_TRITON_MAX_TOKENS), and the step
      # replayed from a prefill CUDA graph (8 sequences, 8192 tokens; a graph's attention is ours)
      PV=(--load-format dummy --expert-placement resident --prefill --input-len 1024 --num-steps 5)
      for v in base attn-triton triton-moe graphs; do
        case $v in
          base) envs=(); extra=(--max-model-len 2048) ;;
          attn-triton) envs=(PAGEDMOE_PREFILL_ATTENTION=triton); extra=(--max-model-len 2048) ;;
          triton-moe) envs=(PAGEDMOE_TRITON_MAX_TOKENS=8192); extra=(--max-model-len 2048) ;;
          graphs) envs=(PAGEDMOE_PREFILL_GRAPH_SEQS=8); extra=(--max-model-len 8192 --prefill-graph-tokens 8192) ;;
        esac
        t env "${envs[@]}" python3 benchmarks/profile_step.py "$Q" "${PV[@]}" "${extra[@]}" --out "$D/pv-$v" \
          > "$D/pv-$v.txt" 2>&1
        echo "--- $v ${envs[*]} ${extra[*]}"; grep -E "^=== prefill|GPU idle|back to back|prefill CUDA graphs|Error" "$D/pv-$v.txt" | head -5
      done ;;
    tune-attn)
      t env OUT="$D" python3 benchmarks/tune_prefill_attention.py > "$D/tune_prefill_attention.log" 2>&1
      grep -E "===|^  auto|^best|w8s2|flash" "$D/tune_prefill_attention.log" | head -40 ;;
    tune)
      t python3 benchmarks/tune_fused_moe.py --models qwen3-30b-a3b mixtral-8x7b --max-s $((RUN_TIMEOUT - 40)) --out "$D/tune" > "$D/tune.log" 2>&1
      tail -20 "$D/tune.log" ;;
    tune-mixtral)
      M=benchmarks/configs/mixtral-8x7b
      t python3 benchmarks/tune_fused_moe.py --models mixtral-8x7b --batches ${TUNE_BATCHES:-256 128} \
        --block-m ${TUNE_BLOCK_M:-32 64 128} --max-s ${TUNE_MAX_S:-200} \
        --resume src/pagedmoe/data/fused_moe_NVIDIA_H200_bfloat16.json --out "$D/tune-mixtral" > "$D/tune-mixtral.log" 2>&1
      tail -8 "$D/tune-mixtral.log"
      t python3 benchmarks/profile_step.py "$M" "${PROF[@]}" --batch-size ${PROF_BATCHES:-256} --out "$D/shipped-mixtral" \
        > "$D/shipped-mixtral.txt" 2>&1
      grep "=== batch" "$D/shipped-mixtral.txt"
      PAGEDMOE_FUSED_MOE_CONFIG=$D/tune-mixtral/fused_moe_NVIDIA_H200_bfloat16.json t python3 benchmarks/profile_step.py \
        "$M" "${PROF[@]}" --batch-size ${PROF_BATCHES:-256} --out "$D/tuned-mixtral" > "$D/tuned-mixtral.txt" 2>&1
      grep "=== batch" "$D/tuned-mixtral.txt" ;;
    gtests)
      t python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_prefill_graphs.py tests/kernels/test_fused_ops.py \
        tests/unit/test_activity_rows.py tests/models/test_gpu_engine.py tests/models/test_dynamic_precision.py \
        tests/models/test_routed_stream_steps.py tests/unit/test_kv_swap.py \
        "tests/kernels/test_paged_attention.py::test_fresh_prefill_through_torch_kernels_gpu" > "$D/gtests.log" 2>&1
      tail -15 "$D/gtests.log" ;;
    before)
      for m in "$Q" benchmarks/configs/mixtral-8x7b; do
        PAGEDMOE_PDL=0 PAGEDMOE_FUSED_MOE_CONFIG=off t python3 benchmarks/profile_step.py "$m" "${PROF[@]}" --backbone-gemm torch \
          --batch-size 1 --out "$D/before-$(basename "$m")" > "$D/before-$(basename "$m").txt" 2>&1
        grep -A14 "=== batch" "$D/before-$(basename "$m").txt" | head -14
      done
      PAGEDMOE_PDL=0 t python3 benchmarks/profile_step.py "$Q" "${PROF[@]}" --batch-size 1 --out "$D/nopdl-qwen3" \
        > "$D/nopdl-qwen3.txt" 2>&1
      grep -A14 "=== batch" "$D/nopdl-qwen3.txt" | head -14 ;;
    pgraphs)
      t python3 -m pytest -q -p no:cacheprovider -m gpu tests/models/test_prefill_graphs.py tests/models/test_gpu_engine.py \
        tests/models/test_paging.py tests/models/test_routed_fetch.py tests/models/test_routed_stream_steps.py \
        tests/kernels/test_fused_moe.py tests/kernels/test_pdl.py tests/e2e/test_async_scheduling.py -k "not variants" \
        > "$D/pgraphs-tests.log" 2>&1
      tail -15 "$D/pgraphs-tests.log"
      for m in "$Q" benchmarks/configs/mixtral-8x7b; do
        t python3 benchmarks/profile_step.py "$m" --load-format dummy --expert-placement resident --prefill \
          --input-len 512 --max-num-batched-tokens 512 --max-model-len 2048 --num-steps 5 \
          --out "$D/pgraphs-$(basename "$m")" > "$D/pgraphs-$(basename "$m").txt" 2>&1
        grep -A12 "=== prefill" "$D/pgraphs-$(basename "$m").txt" | head -14
      done ;;
    *) echo "unknown part $part (tests, gemm, prof, prefill, tune, tune-mixtral, before, pgraphs)" >&2 ;;
  esac
  echo "=== $part took ${SECONDS} s"
done
