#!/usr/bin/env bash
# Reproduce every figure of docs/benchmarks.md on the GPU machine (one NVIDIA H200), stage by stage.
#
#   bash benchmarks/run_all.sh list              # the stages, what each reproduces, its expected time
#   bash benchmarks/run_all.sh STAGE [STAGE...]  # run these stages; results under $OUT/<stage>/
#   bash benchmarks/run_all.sh all               # every GPU stage in order (a machine without a call limit)
#   bash benchmarks/run_all.sh plots DIR [DIR...]  # CPU: merge the sweep.json files under DIRs and redraw
#
# The device tool allows 10 minutes per call, and one call cannot hold all of this: every stage fits one call
# (each is cut at STAGE_TIMEOUT, default 560 s, to leave room for start-up and copying $OUT back), and
# benchmarks/run_lanes.py runs them all, one lane per GPU, over as many calls as they need:
#   run(kind="nvidia-h200-x2", carry=[".whl"], command="python benchmarks/run_lanes.py --call 1 --budget-s 550")
#   run(command="OUT=$OUT bash benchmarks/run_all.sh sweep-mixtral-24")       # or one stage by hand
# then, on the CPU machine, `bash benchmarks/run_all.sh plots <the fetched folders>` draws the combined
# sweep plots into $OUT/plots (copy them to docs/ with the numbers).
#
# Every stage first writes $OUT/<stage>/env.txt: date, commit (git, or $COMMIT when the tree has no .git),
# a dirty-tree flag, GPU name / driver / memory, Python, torch, CUDA, triton, transformers; and pip freeze.
# Per-step timeouts: STAGE_TIMEOUT for a whole stage; gpu_issue4.sh and bench_serve.sh keep their own.
#
# Sweep workload (env, defaults in brackets): SWEEP_INPUT_LEN [1024], SWEEP_OUTPUT_LEN [1024],
# SWEEP_STEADY_STEPS [32; 64 before fb49156: the
# PCIe-bound points then took 1-2 minutes of decode steps each], SWEEP_NUM_PROMPTS [256, a cap on the batch], SWEEP_PLACEMENTS ["resident paged"],
# SWEEP_MAX_MODEL_LEN [2048], SWEEP_MAX_BATCHED [8192: at 16384 the prefill activations (4.25 GiB) leave resident
# Mixtral no KV at weights + 4], SWEEP_EXTRA [more engine flags, e.g. --dtype bfloat16 for a CPU dry run].
# A paged step that streams all of Mixtral's experts over PCIe takes ~1.7 s
# (docs/planner.md), so 1024 output tokens cannot finish inside one device call: each point fills the KV cache
# with as many sequences as 1024 in / 1024 out keeps in flight, times SWEEP_STEADY_STEPS decode steps with the
# cache full and projects the full run (`--steady-decode-steps`, bench/throughput.py); SWEEP_STEADY_STEPS=0
# runs SWEEP_NUM_PROMPTS prompts to the end instead. A stage's budget part may list several budgets joined by
# "_" (sweep-mixtral-24_64); w4 = weights + 4 GiB. `--load-format dummy`: random N(0, 0.02) bf16, never zeros.
# The host tier is pinned with cudaHostRegister at its exact size (Mixtral, every expert paged: 84 GiB of the
# machine's 128 GiB), unregistered when the engine is freed before the next point.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}
STAGE_TIMEOUT=${STAGE_TIMEOUT:-560}
M=${MIXTRAL_MODEL:-benchmarks/configs/mixtral-8x7b}   # overridable for a dry run of the script on CPU
Q=${QWEN3_MODEL:-benchmarks/configs/qwen3-30b-a3b}
G=${GLM_MODEL:-benchmarks/configs/glm-4.5-air}

# stage -> "expected device time [pcie] | what it reproduces": [pcie] streams experts (or offloads) over
# PCIe; [owed] measures what docs/benchmarks.md does not hold yet (benchmarks/run_lanes.py schedules those first)
declare -A STAGES=(
  [gputests]="~2.5 min | every GPU test (pytest -m gpu, 8 workers): engine, paging (plain, VMM, graphs), compressed tier, kernels; then the memory-bound test alone"
  [latency]="~1.9 min | fused-MoE kernel bench; Mixtral decode step vs HBM floor at B = 1/16/64/256 (latency table; benchmarks/gpu_issue4.sh)"
  [throughput-mixtral]="~2.4 min | offline throughput table, 1024 prompts of 512 in / 512 out, resident Mixtral-8x7B (benchmarks/gpu_issue4.sh)"
  [throughput-qwen3]="~1.9 min | the same for Qwen3-30B-A3B"
  [hf]="~0.7 min | HF transformers generate on the Mixtral-8x7B shape, batch 32, 512 in / 32 out"
  [hf-offload-24]="~2.8 min [pcie] | HF generate with accelerate offload at 24 GiB on the GPU (Mixtral-8x7B shape, batch 8, 512 in / 8 out)"
  [hf-offload-64]="~1.2 min [pcie] | the same at 64 GiB"
  [codec]="~0.5 min | lossless codec table: bit-exactness, decoder variants back to back at 256 Mi weights per call, encoder (benchmarks/bench_codec.py)"
  [fused-lossless]="~4 min | MoE layer with every expert in lossless format v2, decoded inside the GEMM, vs bf16-resident, Mixtral-8x7B and Qwen3-30B-A3B at 1/16/64/256 tokens, floors, tile variants, v2 encode rate (issue 23; benchmarks/bench_fused_lossless.py)"
  [dequant]="~0.7 min | dequantisation into the compute buffer vs its HBM floor, per precision and launch shape (benchmarks/bench_dequant.py)"
  [attention]="~0.4 min | paged attention decode/prefill vs floors (benchmarks/bench_attention.py)"
  [dynamic]="~1.8 min | dynamic precision: controller cost on a steady workload and the preemption burst (benchmarks/bench_dynamic.py)"
  [serve-resident]="~1.2 min | serving table, resident row (Qwen3-30B-A3B shape at 60 GiB; benchmarks/bench_serve.sh)"
  [serve-paged]="~3.6 min [pcie] | serving table, paged N=64 row"
  [glm-air]="~4.4 min [pcie] | GLM-4.5-Air shape at 136 GiB, paged + lossless GPU tier, host tier <= HOST_MEMORY_GB (100)"
  [sweep-mixtral-24-paged]="~2.3 min [pcie] | sweep Mixtral-8x7B at 24 GiB (resident does not fit; every expert streams)"
  [sweep-mixtral-24-paged+host-lossless]="~2 min [pcie] | the same with the host tier held compressed"
  [sweep-mixtral-64-paged]="~3.4 min [pcie] | sweep Mixtral-8x7B at 64 GiB (resident does not fit)"
  [sweep-mixtral-64-paged+host-lossless]="~2.8 min [pcie] | the same with the host tier held compressed"
  [sweep-mixtral-w4-resident,paged,paged+lossless]="~1.4 min [pcie] | sweep Mixtral-8x7B at weights + 4 GiB (the headline ratio), with and without the lossless GPU tier"
  [sweep-mixtral-139-resident]="~0.8 min | sweep Mixtral-8x7B at 139 GiB"
  [sweep-qwen3-24-paged,paged+host-lossless]="~4.1 min [pcie] | sweep Qwen3-30B-A3B at 24 GiB, host tier raw and compressed"
  [sweep-qwen3-64-resident,paged,paged+lossless]="~2.6 min [pcie] | sweep Qwen3-30B-A3B at 64 GiB"
  [sweep-qwen3-w4-resident,paged,paged+lossless]="~3.4 min [pcie] | sweep Qwen3-30B-A3B at weights + 4 GiB"
  [sweep-qwen3-139-resident]="~0.8 min | sweep Qwen3-30B-A3B at 139 GiB"
  [sweep-mixtral-w4_64-dynamic]="~3 min | sweep Mixtral-8x7B at weights + 4 and 64 GiB under dynamic precision (lossy rungs under KV pressure; the KV memory lent to experts goes back to the device)"
  [sweep-qwen3-w4_64-dynamic]="~7 min | the same for Qwen3-30B-A3B"
)
ORDER=(gputests latency throughput-mixtral throughput-qwen3 hf hf-offload-24 hf-offload-64 codec fused-lossless dequant attention dynamic serve-resident serve-paged glm-air
       sweep-mixtral-24-paged sweep-mixtral-24-paged+host-lossless sweep-mixtral-64-paged
       sweep-mixtral-64-paged+host-lossless sweep-mixtral-w4-resident,paged,paged+lossless sweep-mixtral-139-resident
       sweep-qwen3-24-paged,paged+host-lossless sweep-qwen3-64-resident,paged,paged+lossless
       sweep-qwen3-w4-resident,paged,paged+lossless sweep-qwen3-139-resident
       sweep-mixtral-w4_64-dynamic sweep-qwen3-w4_64-dynamic)
HOST_FLAG=${HOST_MEMORY_GB:+--host-memory-gb $HOST_MEMORY_GB}

record_env() {  # $1 = folder
  local d=$1 commit dirty
  mkdir -p "$d"
  commit=$(git rev-parse HEAD 2>/dev/null || echo "${COMMIT:-unknown (no .git: pass COMMIT=...)}")
  dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | head -20)
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $commit"
    [ -n "$dirty" ] && echo "uncommitted changes:" && echo "$dirty"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null \
      | sed 's/^/gpu: /' || echo "gpu: none (nvidia-smi failed)"
    python - <<'PY'
import platform, importlib.metadata as md
import torch
print("python:", platform.python_version())
print("torch:", torch.__version__, "cuda:", torch.version.cuda)
for name in ("triton", "transformers", "safetensors", "matplotlib"):
    try:
        print(f"{name}:", md.version(name))
    except md.PackageNotFoundError:
        print(f"{name}: not installed")
PY
    echo "host: $(nproc) cores, $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB memory"}')"
  } > "$d/env.txt" 2>&1
  python -m pip freeze > "$d/pip-freeze.txt" 2>/dev/null || true
  cat "$d/env.txt"
}

sweep() {  # $1 = model folder, $2 = budgets (space separated), $3 = output folder, $4 = placements (space separated)
  # shellcheck disable=SC2086  # budgets, placements and HOST_FLAG are word lists
  timeout --kill-after=15 "$STAGE_TIMEOUT" python -m pagedmoe.cli bench sweep "$1" --load-format dummy \
    --budgets $2 --placements $4 $HOST_FLAG ${SWEEP_EXTRA:-} \
    --num-prompts "${SWEEP_NUM_PROMPTS:-256}" --input-len "${SWEEP_INPUT_LEN:-1024}" \
    --output-len "${SWEEP_OUTPUT_LEN:-1024}" --steady-decode-steps "${SWEEP_STEADY_STEPS:-32}" \
    --max-model-len "${SWEEP_MAX_MODEL_LEN:-2048}" --max-num-seqs 256 \
    --max-num-batched-tokens "${SWEEP_MAX_BATCHED:-8192}" --output-dir "$3" > "$3/sweep.log" 2>&1
  local rc=$?
  grep -E "^\[sweep\]|rror" "$3/sweep.log" | tail -20
  # the table and the files written come last in the log; without them the stage was cut short
  sed -n '/^budget GiB/,$p' "$3/sweep.log"
  return $rc
}

run_stage() {  # $1 = stage
  local s=$1 d="$OUT/$1" rc=0
  mkdir -p "$d"
  echo "=== stage $s: ${STAGES[$s]:-ad hoc (sweep-MODEL-BUDGET: any budget the sweep takes, w4 = weights+4)}"
  record_env "$d"
  local t0=$SECONDS
  case $s in
    gputests)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python -m pytest -q -n 8 -m gpu tests > "$d/pytest.log" 2>&1 || rc=$?
      tail -15 "$d/pytest.log"
      # alone: it reads the whole device's memory (issue 19: the peak within --gpu-memory-gb + 2%)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python -m pytest -q -m gpu tests/e2e/test_memory_bound_gpu.py \
        > "$d/pytest-memory-bound.log" 2>&1 || rc=$?
      tail -5 "$d/pytest-memory-bound.log" ;;
    latency|throughput-*)  # gpu_issue4.sh in parts (its GPU tests are the gputests stage's, its codec bench codec's)
      local skip=(THROUGHPUT_MODELS=" ")
      [ "$s" = throughput-mixtral ] && skip=(SKIP_LATENCY=1 SKIP_KERNEL_BENCH=1 THROUGHPUT_MODELS=$M)
      [ "$s" = throughput-qwen3 ] && skip=(SKIP_LATENCY=1 SKIP_KERNEL_BENCH=1 THROUGHPUT_MODELS=$Q)
      env SKIP_TESTS=1 SKIP_CODEC=1 "${skip[@]}" OUT="$d" timeout --kill-after=15 "$STAGE_TIMEOUT" \
        bash benchmarks/gpu_issue4.sh > "$d/run.log" 2>&1 || rc=$?
      sed -n '/=== summary ===/,$p' "$d/run.log" ;;
    hf)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/hf_generate.py $M --batch 32 --input-len 512 \
        --output-len 32 --output-json "$d/hf_generate_mixtral.json" 2>&1 | tee "$d/hf_generate.log" | tail -3 \
        || rc=$? ;;
    hf-offload-*)
      local gib=${s#hf-offload-}
      timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/hf_generate.py $M --batch 8 --input-len 512 \
        --output-len 8 --gpu-memory-gb "$gib" --output-json "$d/hf_offload_mixtral_${gib}.json" 2>&1 \
        | tee "$d/hf_offload_${gib}.log" | tail -2 || rc=$? ;;
    codec)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/bench_codec.py --numel 268435456 --out "$d" > "$d/bench_codec.log" 2>&1 \
        || rc=$?
      tail -30 "$d/bench_codec.log" ;;
    fused-lossless)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/bench_fused_lossless.py --out "$d" \
        > "$d/bench_fused_lossless.log" 2>&1 || rc=$?
      grep -E "encode|default|wrote" "$d/bench_fused_lossless.log" | tail -12 ;;
    dequant)
      timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/bench_dequant.py --out "$d" > "$d/bench_dequant.log" \
        2>&1 || rc=$?
      tail -6 "$d/bench_dequant.log" ;;
    attention)
      OUT="$d" timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/bench_attention.py > "$d/bench_attention.log" \
        2>&1 || rc=$?
      tail -30 "$d/bench_attention.log" ;;
    dynamic)
      OUT="$d" timeout --kill-after=15 "$STAGE_TIMEOUT" python benchmarks/bench_dynamic.py > "$d/bench_dynamic.log" \
        2>&1 || rc=$?
      tail -20 "$d/bench_dynamic.log" ;;
    serve-resident)
      OUT="$d" timeout --kill-after=15 "$STAGE_TIMEOUT" bash benchmarks/bench_serve.sh resident \
        --expert-placement resident || rc=$? ;;
    serve-paged)
      # shellcheck disable=SC2086
      OUT="$d" timeout --kill-after=15 "$STAGE_TIMEOUT" bash benchmarks/bench_serve.sh paged-n64 \
        --expert-placement paged --num-gpu-experts 64 $HOST_FLAG || rc=$? ;;
    glm-air)
      # The sweep's workload (before 88b5abf this stage left --num-prompts at the sweep's default, 64, which
      # capped the batch at 64 of the 141 sequences the KV cache holds). The first try at 139 GiB without
      # expandable segments ran out of memory to fragmentation (docs/benchmarks.md).
      PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
        HOST_FLAG="--host-memory-gb ${HOST_MEMORY_GB:-100}" sweep "$G" 136 "$d" paged+lossless || rc=$? ;;
    sweep-*)
      # sweep-MODEL-BUDGETS[-PLACEMENTS]: budgets joined by "_" (w4 = weights + 4 GiB), placements by ","
      # (placement names may hold "-" themselves: paged+host-lossless)
      local name=${s#sweep-} model budget rest placements=${SWEEP_PLACEMENTS:-resident paged}
      case ${name%%-*} in mixtral) model=$M ;; qwen3) model=$Q ;; *) echo "unknown model in $s"; return 2 ;; esac
      rest=${name#*-}
      [ "$rest" != "$name" ] && [ -n "$rest" ] || { echo "no budget in $s"; return 2; }
      budget=${rest%%-*}
      [[ $rest == *-* ]] && placements=${rest#*-} && placements=${placements//,/ }
      budget=${budget//_/ }
      budget=${budget//w4/weights+4}
      sweep "$model" "$budget" "$d" "$placements" || rc=$? ;;
    *) echo "unknown stage $s (bash benchmarks/run_all.sh list)"; return 2 ;;
  esac
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && echo "stage $s: TIMED OUT after ${STAGE_TIMEOUT} s (partial results kept)"
  echo "stage $s: exit $rc, $((SECONDS - t0)) s" | tee -a "$OUT/stages.txt"
  return $rc
}

plots() {  # CPU is enough: merge the sweep.json files found under the given folders, one plot set per model
  local dirs=("$@") files
  [ ${#dirs[@]} -gt 0 ] || dirs=("$OUT")
  for m in mixtral qwen3; do
    mapfile -t files < <(find "${dirs[@]}" -path "*sweep-$m-*" -name sweep.json | sort)
    [ ${#files[@]} -gt 0 ] || { echo "no sweep-$m-*/sweep.json under ${dirs[*]}"; continue; }
    python -m pagedmoe.cli bench sweep --replot "${files[@]}" --output-dir "$OUT/plots/$m"
  done
}

case ${1:-list} in
  list)
    for s in "${ORDER[@]}"; do printf '%-18s %s\n' "$s" "${STAGES[$s]}"; done
    echo "plots DIR...       CPU: merge the sweeps' sweep.json under DIR... into \$OUT/plots/{mixtral,qwen3}" ;;
  plots) shift; plots "$@" ;;
  all)
    status=0
    for s in "${ORDER[@]}"; do run_stage "$s" || status=1; done
    plots "$OUT"
    echo "=== stages ==="; cat "$OUT/stages.txt"
    exit $status ;;
  *)
    status=0  # the last failing stage's exit status (124: cut at STAGE_TIMEOUT; run_lanes.py runs it again)
    for s in "$@"; do run_stage "$s" || status=$?; done
    echo "=== stages ==="; cat "$OUT/stages.txt"
    exit $status ;;
esac
