#!/usr/bin/env bash
# Install pagedmoe (editable) with optional extras: `bash scripts/install.sh [dev|serve|...]`.
# A machine without torch gets the CPU build; a machine that has torch (e.g. CUDA) keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip"
if ! python3 -c "import torch" 2>/dev/null; then
    # 2.13.0 is the CPU build available offline on our development machines; an unpinned
    # torch would pull a multi-GB CUDA build.
    $PIP install -q "torch==2.13.0" || $PIP install -q torch
fi
EXTRAS="${1:-}"
if [ -n "$EXTRAS" ]; then
    $PIP install -q -e ".[$EXTRAS]"
else
    $PIP install -q -e .
fi
