#!/usr/bin/env bash
# Online serving benchmark on the GPU machine: start `pagedmoe serve`, run `pagedmoe bench serve` against
# it, save the result JSON, the printed block, the paging metrics and the server log under $OUT, stop the
# server with SIGTERM (it must exit 0).
#
#   bash benchmarks/bench_serve.sh LABEL [extra serve flags...]
#
# Environment (defaults in brackets): MODEL [benchmarks/configs/qwen3-30b-a3b, dummy weights],
# BUDGET_GB [60: Qwen3-30B-A3B's weights are 56.87 GiB, so resident barely fits; see `pagedmoe plan`],
# MAX_MODEL_LEN [4096], NUM_PROMPTS [128], INPUT_LEN [1024], OUTPUT_LEN [128], MAX_CONCURRENCY [256],
# REQUEST_RATE [inf], PREFIX_LEN [0: tokens every prompt starts with, before its INPUT_LEN own ones],
# PORT [8000], OUT [./out], PYTHON [python].
#
# Examples (one device call each):
#   bash benchmarks/bench_serve.sh resident --expert-placement resident
#   bash benchmarks/bench_serve.sh paged-n32 --expert-placement paged --num-gpu-experts 32
set -euo pipefail

LABEL=${1:?usage: bench_serve.sh LABEL [serve flags...]}
shift
MODEL=${MODEL:-benchmarks/configs/qwen3-30b-a3b}
BUDGET_GB=${BUDGET_GB:-60}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-4096}
NUM_PROMPTS=${NUM_PROMPTS:-128}
INPUT_LEN=${INPUT_LEN:-1024}
OUTPUT_LEN=${OUTPUT_LEN:-128}
MAX_CONCURRENCY=${MAX_CONCURRENCY:-256}
REQUEST_RATE=${REQUEST_RATE:-inf}
PORT=${PORT:-8000}
PREFIX_LEN=${PREFIX_LEN:-0}
OUT=${OUT:-./out}
PYTHON=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# The GPU machine's image has no fastapi / uvicorn / pydantic: install the wheels carried in .whl/
# (scripts/fetch_device_wheels.sh; run(carry=[".whl"])) when they are missing.
if ! "$PYTHON" -c "import fastapi, uvicorn, pydantic" 2>/dev/null; then
    ls .whl/*.whl > /dev/null 2>&1 || { echo "fastapi/uvicorn missing and no .whl/: run scripts/fetch_device_wheels.sh and carry .whl"; exit 2; }
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

"$PYTHON" -m pagedmoe.cli serve "$MODEL" --load-format dummy --served-model-name "$(basename "$MODEL")" \
    --gpu-memory-gb "$BUDGET_GB" --max-model-len "$MAX_MODEL_LEN" --port "$PORT" \
    --disable-uvicorn-access-log "$@" > "$OUT/serve-$LABEL.log" 2>&1 &
SERVER=$!
trap 'kill -9 $SERVER 2>/dev/null || true' EXIT

for _ in $(seq 600); do
    if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then break; fi
    if ! kill -0 $SERVER 2> /dev/null; then echo "server exited:"; cat "$OUT/serve-$LABEL.log"; exit 1; fi
    sleep 1
done
grep -E "loaded|experts:" "$OUT/serve-$LABEL.log" || true

"$PYTHON" -m pagedmoe.cli bench serve --port "$PORT" --num-prompts "$NUM_PROMPTS" \
    --random-prefix-len "$PREFIX_LEN" --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" --max-concurrency "$MAX_CONCURRENCY" \
    --request-rate "$REQUEST_RATE" --seed 0 --disable-tqdm --label "$LABEL" \
    --result-file "$OUT/serve-$LABEL.json" | tee "$OUT/bench-serve-$LABEL.txt"

curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^pagedmoe:(kv_cache|num_kv|num_free|num_preempt|expert|generation|prompt|prefix_cache)' \
    > "$OUT/metrics-$LABEL.txt" || true
cat "$OUT/metrics-$LABEL.txt"

kill -TERM $SERVER
STATUS=0
wait $SERVER || STATUS=$?
trap - EXIT
echo "server exit status after SIGTERM: $STATUS"
exit $STATUS
