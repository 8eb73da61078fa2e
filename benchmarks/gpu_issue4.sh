#!/usr/bin/env bash
# GPU fast path (issue 4): kernel + engine tests, decode step vs HBM floor, offline throughput,
# HF transformers for the record. Run on the GPU machine from the repository root; results in $OUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -m pytest -q -m gpu tests/models/test_gpu_engine.py tests/kernels 2>&1 | tail -15 | tee "$OUT/pytest_gpu.txt"
M=benchmarks/configs/mixtral-8x7b
Q=benchmarks/configs/qwen3-30b-a3b
for B in ${LAT_BATCHES:-1 16 64 256}; do
  python -m pagedmoe.cli bench latency $M --load-format dummy --batch-size $B --input-len 1024 --output-len 32 \
    --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 16384 \
    --output-json "$OUT/latency_mixtral_b$B.json" 2>&1 | grep -E "Prefill|Decode|Error|error" | tee -a "$OUT/summary.txt"
done
if [ -n "${THROUGHPUT:-1}" ]; then
  for MODEL in $M $Q; do
    python -m pagedmoe.cli bench throughput $MODEL --load-format dummy --num-prompts ${NUM_PROMPTS:-1024} \
      --input-len 512 --output-len 512 --max-model-len 1024 --max-num-seqs 256 --max-num-batched-tokens 16384 \
      --output-json "$OUT/throughput_$(basename $MODEL).json" 2>&1 | grep -E "Throughput:|rror" | tee -a "$OUT/summary.txt"
  done
fi
python benchmarks/hf_generate.py benchmarks/configs/mixtral-8x7b --batch 32 --input-len 512 --output-len ${HF_OUT_LEN:-32} --output-json "$OUT/hf_mixtral.json" 2>&1 | grep -E "HF transformers|rror" | tee -a "$OUT/summary.txt"
cat "$OUT/summary.txt"
