#!/usr/bin/env bash
# pagedmoe and vLLM 0.24.0 side by side on one GPU, same workloads, one table (issue 25, docs/benchmarks.md).
#
#   bash benchmarks/vs_vllm.sh list                 # the parts, what each runs, expected device time
#   bash benchmarks/vs_vllm.sh PART [PART...]       # run them; logs and the table under $OUT/vs_vllm/
#   bash benchmarks/vs_vllm.sh table DIR [DIR...]   # CPU: one table from the folders of several calls
#   PACK=1 ... PART      # on the device: the folder as one vs_vllm.tgz plus vs_vllm_table.md (a call returns few
#                        # files; the 2026-12-04 lat call lost 11 of its 19 to that limit)
#   bash benchmarks/vs_vllm.sh calls                # the device calls, in order (wheels, then the parts)
#
# Regimes, per model (Qwen3-30B-A3B and Mixtral-8x7B shapes, benchmarks/configs/, --load-format dummy bf16):
#   tput  whole GPU: `vllm bench throughput --gpu-memory-utilization 0.97` vs `pagedmoe bench throughput`
#         resident at the same memory (--gpu-memory-gb = 0.97 x the device); random 1024 in / 1024 out,
#         512 prompts, --max-num-seqs 256 --max-num-batched-tokens 8192, full runs (no steady-state projection)
#   w4    weights + 4 GiB (W4_VARIANTS: the pagedmoe variants after vLLM, default resident, "" none; W4_VLLM=0 skips
#         vLLM; W4P_VARIANTS: part w4p's, default "paged-lossless auto"; paged-hibyte: the tier read by the GEMM,
#         --compressed-gemm fused-hibyte): vLLM at --gpu-memory-utilization = budget / device memory vs pagedmoe at
#         --gpu-memory-gb budget: resident (part w4), paged + lossless GPU tier and the planner's auto choice
#         (part w4p); W4_PROMPTS prompts (default 96: more than either engine holds at once, about 20k KV tokens
#         for vLLM, 82 sequences for paged + lossless; 40, the issue's count, favoured the engine that holds fewer)
#   pf    prefill: the whole GPU as tput, PF_PROMPTS (default 1024) random prompts of 1024 tokens, 1 token out each:
#         total tokens/s (prompt + the one sampled token), both engines chunking at 8192 tokens a step (issue 25,
#         item 3: the prefill against its compute floor, here against vLLM's)
#   lat   batch 1, 512 in + 64 out: `vllm bench latency` (Avg latency) vs `pagedmoe bench latency --batch-size 1`
#         (prefill + every decode step), pagedmoe with --fused-ops PM_FUSED (default on; "off on" for both); then
#         benchmarks/profile_step.py at batch 1 and 256 for the per-kernel-class breakdown, each PM_FUSED value
# Every vLLM run of one model uses the same engine flags (--max-model-len 3072 --max-num-seqs 256
# --max-num-batched-tokens 8192; only the memory fraction differs), so after the model's first start the
# torch.compile cache in VLLM_CACHE_ROOT (kept on the warm machine between calls) should be hit.
#
# vLLM comes from the wheels ../shared/peers/vllm.md carries into /tmp/site (`calls` prints the sequence);
# its runs get PYTHONPATH=/tmp/site, pagedmoe's PYTHONPATH=src (the device's own torch for both).
# Each run is cut at RUN_TIMEOUT (default 420 s) so one hang cannot take the whole call.
# Dry run on CPU (tests/unit/test_vs_vllm.py): a stand-in vllm package in VLLM_SITE, the tiny default model
# (QWEN3_MODEL/MIXTRAL_MODEL), DEVICE_GIB for the device memory, PM_EXTRA for engine flags (--device cpu) and
# the workload sizes shrunk through MAX_LEN, TPUT_PROMPTS, TPUT_LEN, LAT_IN, LAT_OUT, PROF_BATCHES, PROF_LEN,
# PROF_STEPS (profile_step.py's --num-steps, default 10).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
D=$OUT/vs_vllm
RUN_TIMEOUT=${RUN_TIMEOUT:-420}
W4_PROMPTS=${W4_PROMPTS:-96} PF_PROMPTS=${PF_PROMPTS:-1024}
PM_FUSED=${PM_FUSED:-on}
TPUT_PROMPTS=${TPUT_PROMPTS:-512} TPUT_LEN=${TPUT_LEN:-1024} LAT_IN=${LAT_IN:-512} LAT_OUT=${LAT_OUT:-64}
PROF_BATCHES=${PROF_BATCHES:-1 256} PROF_LEN=${PROF_LEN:-512} PROF_STEPS=${PROF_STEPS:-10}
read -r -a PM_EXTRA <<< "${PM_EXTRA:-}"
SITE=${VLLM_SITE:-/tmp/site}
export VLLM_CACHE_ROOT=${VLLM_CACHE_ROOT:-/tmp/vllm-cache} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
declare -A MODELS=([qwen3]=${QWEN3_MODEL:-benchmarks/configs/qwen3-30b-a3b} [mixtral]=${MIXTRAL_MODEL:-benchmarks/configs/mixtral-8x7b})
declare -A NAMES=([qwen3]=qwen3-30b-a3b [mixtral]=mixtral-8x7b)
MAX_LEN=${MAX_LEN:-3072}  # > 1024 + 1024 after vLLM re-tokenises the random prompts (vllm.md)
COMMON_VLLM=(--load-format dummy --max-model-len "$MAX_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192)
COMMON_PM=(--load-format dummy --max-model-len "$MAX_LEN" --max-num-seqs 256 --max-num-batched-tokens 8192 "${PM_EXTRA[@]}")
TPUT=(--num-prompts "$TPUT_PROMPTS" --input-len "$TPUT_LEN" --output-len "$TPUT_LEN")

# part -> "expected device time | what it runs" (estimates from the 2026-12-01 runs: vLLM's first start
# compiles 1.5-2.5 min, later starts ~0.7 min; pagedmoe starts ~0.7 min; run times from the issue's figures)
declare -A PARTS=(
  [tput-qwen3]="~6.5 min | whole GPU: vLLM (start 2.5 + 512 x 1024 out at ~7600 tok/s 1.2) + pagedmoe resident (0.7 + ~1.8)"
  [tput-mixtral]="~8 min | the same for Mixtral-8x7B (vLLM ~3 + ~1.7, pagedmoe 1 + ~2.1 at ~4400 tok/s)"
  [lat-qwen3]="~4 min | batch 1: vLLM latency (0.7 + 0.3), pagedmoe latency x PM_FUSED (2 x 0.8), profile_step B=1,256 x PM_FUSED (2 x 0.8)"
  [lat-mixtral]="~4.5 min | the same for Mixtral-8x7B"
  [w4-qwen3]="~7 min | weights + 4 GiB (60.87 GiB), 96 prompts: vLLM (0.7 + ~1.8 at ~900 tok/s) + pagedmoe resident (0.7 + ~3.2 at ~510)"
  [w4p-qwen3]="~4.5 min | the same budget and prompts: pagedmoe paged+lossless (0.7 + ~1.3 at ~1300 tok/s), auto (0.7 + ~1.3)"
  [w4-mixtral]="~8 min | the same for Mixtral-8x7B (weights + 4 = 91 GiB; few sequences fit, so slower per prompt)"
  [w4p-mixtral]="~4.5 min | the same for Mixtral-8x7B (paged+lossless ~880 tok/s in the sweep)"
  [pf-qwen3]="~3 min | prefill, whole GPU, 1024 x 1024 in / 1 out: vLLM (0.7 + ~0.3 at ~65k tok/s) + pagedmoe (0.7 + ~0.3)"
  [pf-mixtral]="~4 min | the same for Mixtral-8x7B (~20k tok/s: ~0.9 min each)"
)
ORDER=(tput-qwen3 lat-qwen3 w4-qwen3 w4p-qwen3 pf-qwen3 tput-mixtral lat-mixtral w4-mixtral w4p-mixtral pf-mixtral)
# Calls of <= 10 min (the device tool's limit; each part is cut at RUN_TIMEOUT per run), ~34 min in all, more
# than one session's 30 min of device time with the wheels' staging (~1.5 min): session 1 runs calls 1-2 (Qwen3,
# ~15.5 min: the issue's headline shape), session 2 calls 3-5 (Mixtral, ~18.5 min). A part's vLLM runs after
# the first of its model on the same warm machine reuse the compile cache, so keep a model's calls together.
CALLS=("tput-qwen3" "lat-qwen3 w4p-qwen3" "w4-qwen3 pf-qwen3" "tput-mixtral" "lat-mixtral w4p-mixtral" "w4-mixtral"
       "pf-mixtral")

vllm() {  # the vLLM CLI on the carried wheels
  env PYTHONPATH="$SITE" VLLM_USE_FLASHINFER_SAMPLER=0 TVM_FFI_DISABLE_TORCH_C_DLPACK=1 \
    timeout --kill-after=15 "$RUN_TIMEOUT" python3 -m vllm.entrypoints.cli.main "$@"
}
pm() { env PYTHONPATH=src timeout --kill-after=15 "$RUN_TIMEOUT" python3 -m pagedmoe.cli "$@"; }

vllm_model_dir() {  # $1 = key: config.json + any local tokenizer (random prompts: ids stay below its vocabulary)
  local dir=/tmp/vs_vllm_models/${NAMES[$1]}
  mkdir -p "$dir"
  cp "${MODELS[$1]}/config.json" "$dir/"
  cp src/pagedmoe/default_model/tokenizer.json src/pagedmoe/default_model/tokenizer_config.json \
     src/pagedmoe/default_model/special_tokens_map.json "$dir/" 2>/dev/null
  echo "$dir"
}

device_gib() {
  [ -n "${DEVICE_GIB:-}" ] && { echo "$DEVICE_GIB"; return; }
  python3 -c "import torch; print(torch.cuda.get_device_properties(0).total_memory / 2**30)"
}
weights_gib() {  # $1 = model folder: the bf16 weights pagedmoe's planner counts (planning/model_shape.py)
  PYTHONPATH=src python3 -c "import sys; from pagedmoe.planning.model_shape import ModelShape; \
print(ModelShape.from_hf_config(sys.argv[1]).weight_bytes / 2**30)" "$1"
}

write_meta() {  # $1 = key
  local name=${NAMES[$1]} total w budget
  total=$(device_gib); w=$(weights_gib "${MODELS[$1]}")
  budget=$(python3 -c "print(round($w + 4, 2))")
  python3 - "$D/$name.meta.json" "$total" "$w" "$budget" <<'PY'
import json, sys
path, total, w, budget = sys.argv[1], *map(float, sys.argv[2:])
json.dump({"device_gib": total, "weights_gib": w, "w4_budget_gib": budget, "w4_utilization": round(budget / total, 4),
           "tput_utilization": 0.97, "tput_gib": 0.97 * total}, open(path, "w"), indent=1)
PY
}
meta() { python3 -c "import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$D/${NAMES[$1]}.meta.json" "$2"; }

record_env() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo "${COMMIT:-unknown (no .git: pass COMMIT=...)}")"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
    env PYTHONPATH="$SITE" python3 -c "import vllm; print('vllm', vllm.__version__)" 2>&1 | tail -1
  } > "$D/env.txt" 2>&1
  cat "$D/env.txt"
}

run_part() {  # $1 = part
  local regime=${1%%-*} key=${1#*-} name m vdir
  name=${NAMES[$key]}; m=${MODELS[$key]}
  [ -f "$D/$name.meta.json" ] || write_meta "$key"
  vdir=$(vllm_model_dir "$key")
  case $regime in
    tput)
      local util=0.97 gib; gib=$(meta "$key" tput_gib)
      echo "--- $name tput vllm (utilization $util)"
      vllm bench throughput --model "$vdir" "${COMMON_VLLM[@]}" --dataset-name random --random-input-len "$TPUT_LEN" \
        --random-output-len "$TPUT_LEN" --num-prompts "$TPUT_PROMPTS" --gpu-memory-utilization $util \
        --output-json "$D/$name.tput.vllm.json" > "$D/$name.tput.vllm.log" 2>&1
      tail -3 "$D/$name.tput.vllm.log"
      echo "--- $name tput pagedmoe resident (--gpu-memory-gb $gib)"
      pm bench throughput "$m" "${COMMON_PM[@]}" "${TPUT[@]}" --expert-placement resident --gpu-memory-gb "$gib" \
        --output-json "$D/$name.tput.pagedmoe.json" > "$D/$name.tput.pagedmoe.log" 2>&1
      tail -3 "$D/$name.tput.pagedmoe.log" ;;
    w4|w4p)
      local util gib variants; util=$(meta "$key" w4_utilization); gib=$(meta "$key" w4_budget_gib)
      if [ "$regime" = w4 ] && [ "${W4_VLLM:-1}" = 0 ]; then   # W4_VLLM=0: the pagedmoe variants alone
        variants=${W4_VARIANTS-resident}
      elif [ "$regime" = w4 ]; then
        echo "--- $name w4 vllm (utilization $util = $gib GiB)"
        vllm bench throughput --model "$vdir" "${COMMON_VLLM[@]}" --dataset-name random --random-input-len "$TPUT_LEN" \
          --random-output-len "$TPUT_LEN" --num-prompts "$W4_PROMPTS" --gpu-memory-utilization "$util" \
          --output-json "$D/$name.w4.vllm.json" > "$D/$name.w4.vllm.log" 2>&1
        tail -3 "$D/$name.w4.vllm.log"
        # W4_VARIANTS="paged-lossless": vLLM and the paged tier in one call; W4_VARIANTS="": vLLM alone
        variants=${W4_VARIANTS-resident}
      else
        variants=${W4P_VARIANTS:-paged-lossless auto}
      fi
      local variant flags
      for variant in $variants; do
        case $variant in
          resident) flags=(--expert-placement resident) ;;
          paged-lossless) flags=(--expert-placement paged --expert-compression lossless --compressed-gemm decode) ;;
          # the same tier read in the MoE GEMM (issue 23: format version 3, tile-major, decoded in the MMA operands)
          paged-hibyte) flags=(--expert-placement paged --expert-compression lossless --compressed-gemm fused-hibyte) ;;
          auto) flags=(--expert-placement auto --expert-compression lossless) ;;
          *) echo "unknown variant $variant (resident, paged-lossless, paged-hibyte, auto)" >&2; return 2 ;;
        esac
        echo "--- $name w4 pagedmoe $variant (--gpu-memory-gb $gib)"
        pm bench throughput "$m" "${COMMON_PM[@]}" --num-prompts "$W4_PROMPTS" --input-len "$TPUT_LEN" --output-len "$TPUT_LEN" \
          "${flags[@]}" --gpu-memory-gb "$gib" --output-json "$D/$name.w4.pagedmoe-$variant.json" \
          > "$D/$name.w4.pagedmoe-$variant.log" 2>&1
        tail -3 "$D/$name.w4.pagedmoe-$variant.log"
      done ;;
    pf)
      local gib; gib=$(meta "$key" tput_gib)
      echo "--- $name pf vllm (utilization 0.97)"
      vllm bench throughput --model "$vdir" "${COMMON_VLLM[@]}" --dataset-name random --random-input-len "$TPUT_LEN" \
        --random-output-len 1 --num-prompts "$PF_PROMPTS" --gpu-memory-utilization 0.97 \
        --output-json "$D/$name.pf.vllm.json" > "$D/$name.pf.vllm.log" 2>&1
      tail -3 "$D/$name.pf.vllm.log"
      echo "--- $name pf pagedmoe resident (--gpu-memory-gb $gib)"
      pm bench throughput "$m" "${COMMON_PM[@]}" --num-prompts "$PF_PROMPTS" --input-len "$TPUT_LEN" --output-len 1 \
        --expert-placement resident --gpu-memory-gb "$gib" --output-json "$D/$name.pf.pagedmoe.json" \
        > "$D/$name.pf.pagedmoe.log" 2>&1
      tail -3 "$D/$name.pf.pagedmoe.log" ;;
    lat)
      echo "--- $name lat vllm"
      vllm bench latency --model "$vdir" "${COMMON_VLLM[@]}" --batch-size 1 --input-len "$LAT_IN" --output-len "$LAT_OUT" \
        --gpu-memory-utilization 0.97 --num-iters-warmup 3 --num-iters 10 \
        --output-json "$D/$name.lat.vllm.json" > "$D/$name.lat.vllm.log" 2>&1
      tail -4 "$D/$name.lat.vllm.log"
      local f
      for f in $PM_FUSED; do
        echo "--- $name lat pagedmoe --fused-ops $f"
        pm bench latency "$m" "${COMMON_PM[@]}" --batch-size 1 --input-len "$LAT_IN" --output-len "$LAT_OUT" \
          --expert-placement resident --fused-ops "$f" --output-json "$D/$name.lat.pagedmoe-fused-$f.json" \
          > "$D/$name.lat.pagedmoe-fused-$f.log" 2>&1
        tail -2 "$D/$name.lat.pagedmoe-fused-$f.log"
        echo "--- $name profile_step B=1,256 --fused-ops $f"
        env PYTHONPATH=src timeout --kill-after=15 "$RUN_TIMEOUT" python3 benchmarks/profile_step.py "$m" \
          --load-format dummy --expert-placement resident --batch-size $PROF_BATCHES --input-len "$PROF_LEN" \
          --num-steps "$PROF_STEPS" --max-model-len "$MAX_LEN" "${PM_EXTRA[@]}" --fused-ops "$f" --out "$D/$name.prof-fused-$f" \
          > "$D/$name.prof-fused-$f.txt" 2>&1
        grep -A14 "=== batch" "$D/$name.prof-fused-$f.txt" | head -40
      done ;;
    *) echo "unknown part $1; bash benchmarks/vs_vllm.sh list" >&2; return 2 ;;
  esac
}

case ${1:-list} in
  list)
    for p in "${ORDER[@]}"; do printf '%-13s %s\n' "$p" "${PARTS[$p]}"; done
    echo "calls: ${#CALLS[@]} (bash benchmarks/vs_vllm.sh calls)" ;;
  calls)
    echo "# 0. on this machine, once:  bash ../shared/peers/stage_vllm.sh   (.vllm/parts/wheels.tar.part*)"
    echo "# 1. one device call per part, back to back (a warm machine keeps /tmp between calls). The working tree travels"
    echo "#    with each call and a call carries 64 MiB in all: move src/pagedmoe/default_model, benchmarks/results and"
    echo "#    docs out of the tree for these calls (mv them to /tmp/hold; put them back before the benchmark calls)"
    for part in .vllm/parts/wheels.tar.part*; do
      [ -e "$part" ] || { echo "#    (no parts staged yet)"; break; }
      echo "#    rm -rf .vllm/now && mkdir -p .vllm/now && cp $part .vllm/now/"
      echo "run(carry=[\".vllm/now\"], command=\"mkdir -p /tmp/vllm && cp .vllm/now/* /tmp/vllm/\")"
    done
    echo "run(command=\"cat /tmp/vllm/wheels.tar.part* | tar xf - -C /tmp/vllm && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /tmp/vllm/*.whl && PYTHONPATH=/tmp/site python3 -c 'import vllm; print(vllm.__version__)'\")"
    i=0
    for c in "${CALLS[@]}"; do
      i=$((i + 1))
      echo "run(timeout_s=600, command=\"PACK=1 OUT=\$OUT bash benchmarks/vs_vllm.sh $c\")   # call $i"
    done
    echo "# then here: bash benchmarks/vs_vllm.sh table <each call's files_at>/vs_vllm ..." ;;
  table)
    shift
    python3 benchmarks/vs_vllm_table.py "$@" ;;
  *)
    mkdir -p "$D"
    record_env
    rc=0
    for part in "$@"; do
      [ -n "${PARTS[$part]:-}" ] || { echo "unknown part $part; bash benchmarks/vs_vllm.sh list" >&2; exit 2; }
    done
    for part in "$@"; do
      echo "=== $part: ${PARTS[$part]}"
      SECONDS=0
      run_part "$part" || rc=1
      echo "=== $part took ${SECONDS} s"
    done
    python3 benchmarks/vs_vllm_table.py "$D" || rc=1
    if [ "${PACK:-0}" = 1 ]; then  # a device call returns only a few files: one archive and the table
      bash benchmarks/pack_out.sh "$D" table.md env.txt || rc=1
    fi
    exit $rc ;;
esac
