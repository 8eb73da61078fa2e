#!/usr/bin/env bash
# Issue 24's GPU runs: tensor and expert parallelism over NCCL (dummy bf16 weights, 1024 in / 1024 out,
# steady-state decode as in gpu_issue5.sh). Nothing here has run yet: the CPU side is tested in CI
# (tests/models/test_tensor_parallel.py); these runs owe the figures in docs/benchmarks.md.
#   x2:  run(kind="nvidia-h200-x2", command="COMMIT=<HEAD> bash benchmarks/gpu_issue24.sh mixtral")   # then qwen3
#        Mixtral-8x7B and Qwen3-30B-A3B at a per-GPU budget of weights/2 + 4 GiB: one GPU (paged + lossless
#        host tier: resident cannot load) against TP=2 and EP=2 (= --tensor-parallel-size 2
#        --enable-expert-parallel, vLLM's meaning), each resident and paged + lossless.
#   x8:  run(kind="nvidia-h200-x8", command="COMMIT=<HEAD> bash benchmarks/gpu_issue24.sh glm")
#        GLM-4.5 (355B) EP=8 paged + lossless at 64 GiB a GPU (resident needs 84.7 GiB a rank), beside `pagedmoe plan` for the same rank.
# NCCL's NVLink multicast stays off (the engine sets these for its ranks too).
# Results: $OUT/<point>.json (bench throughput's JSON), $OUT/issue24-<part>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-out}
M=benchmarks/configs/mixtral-8x7b
Q=benchmarks/configs/qwen3-30b-a3b
G=benchmarks/configs/glm-4.5
mkdir -p "$OUT"
LOG="$OUT/issue24-${1:-mixtral}.log"

half_plus_4() {  # per-GPU budget in GiB: the bf16 weights / 2 + 4
  python -c "import sys; from pagedmoe.planning.model_shape import ModelShape as S; \
print('%.2f' % (S.from_hf_config(sys.argv[1]).weight_bytes / 2**31 + 4))" "$1"
}

point() {  # name model timeout_s flags...   (one bench throughput run)
  local name=$1 model=$2 limit=$3; shift 3
  echo "=== $name: $model $* (limit ${limit} s)" | tee -a "$LOG"
  timeout --kill-after=15 "$limit" python -m pagedmoe.cli bench throughput "$model" --load-format dummy \
    --num-prompts 256 --input-len 1024 --output-len 1024 --steady-decode-steps 64 --max-model-len 2048 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 "$@" --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "exit $?" | tee -a "$LOG"
  grep -E "Throughput|throughput|Error|error|tensor parallel" "$OUT/$name.log" | tail -6 | tee -a "$LOG"
}

pair() {  # prefix model: one GPU, TP=2, EP=2 at weights/2 + 4 GiB a GPU
  local p=$1 model=$2 b
  b=$(half_plus_4 "$model")
  echo "per-GPU budget ${b} GiB" | tee -a "$LOG"
  point "$p-1gpu-paged-lossless" "$model" 150 --gpu-memory-gb "$b" --expert-placement paged --host-compression lossless
  point "$p-tp2-resident" "$model" 110 --gpu-memory-gb "$b" --tensor-parallel-size 2 --expert-placement resident
  point "$p-tp2-paged-lossless" "$model" 110 --gpu-memory-gb "$b" --tensor-parallel-size 2 --expert-placement paged \
    --host-compression lossless
  point "$p-ep2-resident" "$model" 110 --gpu-memory-gb "$b" --tensor-parallel-size 2 --enable-expert-parallel \
    --expert-placement resident
  point "$p-ep2-paged-lossless" "$model" 110 --gpu-memory-gb "$b" --tensor-parallel-size 2 --enable-expert-parallel \
    --expert-placement paged --host-compression lossless
}

{
  echo "date: $(date -u +%FT%TZ) commit: ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$LOG"

case ${1:-mixtral} in
  mixtral) pair mixtral $M ;;
  qwen3) pair qwen3 $Q ;;
  glm)
    python -m pagedmoe.cli plan $G --gpu-memory-gb 64 --tensor-parallel-size 8 --enable-expert-parallel \
      --expert-placement paged --host-compression lossless --input-len 1024 --output-len 1024 | tee -a "$LOG"
    point glm45-ep8-paged-lossless $G 560 --gpu-memory-gb 64 --tensor-parallel-size 8 --enable-expert-parallel \
      --expert-placement paged --host-compression lossless ;;
  *) echo "part: mixtral | qwen3 | glm" >&2; exit 2 ;;
esac
