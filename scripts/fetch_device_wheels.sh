#!/usr/bin/env bash
# Wheels the GPU machine lacks for `pagedmoe serve` (its image has httpx, prometheus-client and anyio, not
# fastapi / uvicorn / pydantic): downloaded here into .whl/ (git-ignored) for Python 3.12 x86-64, carried
# with `run(carry=[".whl"])` and installed there by benchmarks/bench_serve.sh (/tmp/site on PYTHONPATH).
#
#   bash scripts/fetch_device_wheels.sh        # once per checkout, on a machine with the package registry
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(fastapi==0.165.0 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0
        typing-inspection==0.4.2 uvicorn==0.54.0 opentelemetry-api==1.45.2 typing-extensions==4.16.0)
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
ls -1 .whl
