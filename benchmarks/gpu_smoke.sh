#!/usr/bin/env bash
# Quick GPU validation: engine + paging GPU tests, then one Mixtral-shape decode latency point.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 PAGEDMOE_NO_PROGRESS=1
OUT=${OUT:-out}; mkdir -p "$OUT"
git rev-parse HEAD 2>/dev/null | tee "$OUT/commit.txt"
timeout 240 python -m pytest -q -x -m gpu tests/models/test_gpu_engine.py tests/models/test_gpu_paging.py 2>&1 | tail -25 | tee "$OUT/pytest_gpu.txt"
timeout 200 python -m pagedmoe.cli bench latency benchmarks/configs/mixtral-8x7b --load-format dummy --batch-size 64 \
  --input-len 1024 --output-len 16 --max-model-len 2048 --max-num-seqs 64 --max-num-batched-tokens 16384 \
  --output-json "$OUT/latency_mixtral_b64.json" 2>&1 | tail -6
