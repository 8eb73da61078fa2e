"""benchmarks/memory_bound.py's table (CPU): peak / budget from each point's device_memory, throughput
against the docs' figure for the same point, refusals with the minimum they name."""
import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "memory_bound.py"


def load():
    spec = importlib.util.spec_from_file_location("memory_bound", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_table_reads_sweep_points(tmp_path):
    mb = load()
    points = [
        {"model": "qwen3-30b-a3b", "budget_arg": "24", "budget_gib": 24.0, "placement": "paged", "status": "ok",
         "output_tokens_per_second": 73.1, "num_requests": 80, "kv_capacity_tokens": 160000,
         "device_memory": {"peak_gib": 23.9, "used_gib": 23.0, "peak_over_budget": 23.9 / 24,
                           "torch_peak_reserved_gib": 20.0, "stages_gib": {"loaded": 9.0}}},
        {"model": "qwen3-30b-a3b", "budget_arg": "24", "budget_gib": 24.0, "placement": "resident",
         "status": "does_not_fit", "needs_gib": 60.64, "message": "..."},
    ]
    (tmp_path / "qwen3-24").mkdir()
    (tmp_path / "qwen3-24" / "sweep.json").write_text(json.dumps({"points": points, "git_commit": "abc"}))
    rows = mb.collect([tmp_path])
    assert rows[0]["vs_docs"] == 73.1 / 81.22 and rows[0]["peak_over_budget"] == 23.9 / 24
    text = mb.table([tmp_path])
    assert "0.996" in text and "does not fit (needs 60.64 GiB)" in text and "worst peak/budget 0.996" in text
    # every stage of both parts is a sweep of placements the sweep knows
    from pagedmoe.bench.sweep import PLACEMENTS

    assert all(set(p) <= set(PLACEMENTS) for part in mb.PARTS.values() for _, _, _, p in part)
