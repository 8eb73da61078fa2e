"""benchmarks/bench_prefix.sh end to end on CPU with a tiny model: four servers (resident / paged, prefix
caching on / off), one table, the cache hit only where caching is on."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_prefix_smoke(tiny_model_dir, tmp_path):
    env = dict(os.environ, MODEL=str(tiny_model_dir), BUDGET_GB="1", MAX_MODEL_LEN="256", PREFIX_LEN="64",
               INPUT_LEN="8", OUTPUT_LEN="4", NUM_PROMPTS="6", MAX_CONCURRENCY="6",
               PAGED_FLAGS="--expert-placement paged --num-gpu-experts 2",
               SERVE_FLAGS="--device cpu --max-num-seqs 8", PORT=str(_free_port()), OUT=str(tmp_path),
               PYTHON=sys.executable, OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/bench_prefix.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = proc.stdout[proc.stdout.index("shared prefix 64 tokens"):].splitlines()
    assert table[1].split()[:3] == ["run", "prefix", "cache"]
    rows = {tuple(line.split()[:2]): line.split() for line in table[2:6]}
    assert set(rows) == {(p, c) for p in ("resident", "paged") for c in ("on", "off")}
    for (placement, caching), cols in rows.items():
        hit = float(cols[-1])
        assert (hit > 50) if caching == "on" else hit == 0.0, (placement, caching, hit)
        assert all(re.fullmatch(r"[\d.]+", v) for v in cols[2:])
