"""benchmarks/memory_peak.py's replay of torch's allocation history (the GPU run records it; the replay is Python)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from memory_peak import peak_sites, site  # noqa: E402


def _frames(path, line, name):
    return [{"filename": "/opt/torch/.venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1,
             "name": "linear"},
            {"filename": f"/work/main/src/pagedmoe/{path}", "line": line, "name": name},
            {"filename": "/work/main/src/pagedmoe/engine/llm_engine.py", "line": 9, "name": "step"}]


def test_peak_sites_groups_the_live_bytes_at_the_peak_by_pagedmoe_frame():
    a, b = _frames("experts/routed.py", 120, "lookup"), _frames("models/layers/moe.py", 40, "forward")
    events = [
        {"action": "free_completed", "addr": 7, "size": 999},        # start-up's block: ignored
        {"action": "alloc", "addr": 1, "size": 100, "frames": a, "time_us": 1},
        {"action": "alloc", "addr": 2, "size": 300, "frames": b, "time_us": 2},
        {"action": "free_requested", "addr": 2, "size": 300},        # not yet free on its stream
        {"action": "alloc", "addr": 3, "size": 50, "frames": a, "time_us": 3},   # peak: 450
        {"action": "free_completed", "addr": 2, "size": 300},
        {"action": "alloc", "addr": 4, "size": 200, "frames": b, "time_us": 4},  # 350 < 450
    ]
    res = peak_sites(events)
    assert res["peak_bytes"] == 450 and res["peak_time_us"] == 3
    assert res["sites"] == [("models/layers/moe.py:40 forward", 300, 1), ("experts/routed.py:120 lookup", 150, 2)]
    assert site([]) == "?" and site(a) == "experts/routed.py:120 lookup"
    assert peak_sites([])["peak_bytes"] == 0 and peak_sites([])["sites"] == []
