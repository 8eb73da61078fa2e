"""benchmarks/run_lanes.py: run_all.sh's stage list parses, and the schedule places every stage exactly once,
PCIe-bound stages only on the GPUs allowed them, the same way in every call."""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import run_lanes  # noqa: E402


def test_run_all_stages_parse():
    stages = run_lanes.list_stages()
    names = [s.name for s in stages]
    assert len(names) == len(set(names)) >= 15
    assert {"gputests", "glm-air", "serve-paged", "sweep-mixtral-w4-resident,paged,paged+lossless"} <= set(names)
    assert all(s.minutes > 0 for s in stages)
    assert {s.name for s in stages if s.pcie} >= {"glm-air", "sweep-mixtral-24-paged", "hf-offload"}
    assert not any(s.pcie for s in stages if s.name in ("codec", "gputests", "sweep-qwen3-139-resident"))
    # [owed] marks what docs/benchmarks.md lacks, so the set changes with the results: parsed, not fixed here
    text = subprocess.run(["bash", str(run_lanes.RUN_ALL), "list"], capture_output=True, text=True).stdout
    marked = {line.split()[0] for line in text.splitlines() if "[owed]" in line.split("|")[0]}
    assert {s.name for s in stages if s.owed} == marked


def test_owed_stages_are_scheduled_first():
    stages = [run_lanes.Stage("a", 5.0, False, False), run_lanes.Stage("b", 1.0, False, True),
              run_lanes.Stage("c", 3.0, False, False)]
    bins, left_out = run_lanes.schedule(stages, 1, 1, [0], budget_min=4.0)
    assert [s.name for s in bins[0][0]] == ["b", "c"] and [s.name for s in left_out] == ["a"]


@pytest.mark.parametrize("gpus,calls,pcie", [(4, 2, [0, 1, 2, 3]), (8, 1, [0, 2, 4, 6]), (1, 3, [0]), (2, 2, [1])])
def test_schedule_places_each_stage_once_pcie_where_allowed(gpus, calls, pcie):
    stages = run_lanes.list_stages()
    bins, left_out = run_lanes.schedule(stages, gpus, calls, pcie)
    assert left_out == []   # no budget: everything placed
    placed = [(c, g, s) for c, call in enumerate(bins) for g, lane in enumerate(call) for s in lane]
    assert sorted(s.name for _, _, s in placed) == sorted(s.name for s in stages)
    assert all(g in pcie for _, g, s in placed if s.pcie)
    assert (bins, left_out) == run_lanes.schedule(stages, gpus, calls, pcie)   # every call: the same plan
    loads = [sum(s.minutes for s in lane) for call in bins for lane in call]
    longest = max(s.minutes for s in stages)
    # LPT: no bin exceeds the average by more than the longest stage (among bins any stage may use)
    if len(pcie) == gpus:
        assert max(loads) <= sum(loads) / len(loads) + longest


def test_schedule_keeps_each_bin_within_the_budget_owed_stages_first():
    stages = run_lanes.list_stages()
    budget = 8.5
    bins, left_out = run_lanes.schedule(stages, 2, 2, [0, 1], budget)
    assert all(sum(s.minutes for s in lane) <= budget for call in bins for lane in call)
    placed = [s for call in bins for lane in call for s in lane]
    assert sorted(s.name for s in placed + left_out) == sorted(s.name for s in stages) and left_out
    # a stage is left out only if it could not fit where an owed stage could: owed ones go first
    owed_out = [s for s in left_out if s.owed]
    assert not owed_out or all(s.owed for s in placed)


def test_schedule_refuses_pcie_stages_without_pcie_gpus():
    with pytest.raises(ValueError, match="--pcie-gpus"):
        run_lanes.schedule(run_lanes.list_stages(), 2, 1, [])


def test_run_all_sweep_stage_runs_its_budgets_and_placements(tmp_path):
    """A sweep stage's name carries the model, the budgets and the placements (whose names hold '-' and
    '+'): run on the CPU with the embedded model standing in for Mixtral, each point is measured."""
    import json
    import os
    import subprocess

    root = Path(__file__).resolve().parents[2]
    stage = "sweep-mixtral-w4_2-paged,paged+host-lossless"
    env = dict(os.environ, OUT=str(tmp_path), MIXTRAL_MODEL="src/pagedmoe/default_model", SWEEP_STEADY_STEPS="1",
               SWEEP_INPUT_LEN="8", SWEEP_OUTPUT_LEN="8", SWEEP_MAX_MODEL_LEN="32", SWEEP_NUM_PROMPTS="2",
               SWEEP_EXTRA="--dtype bfloat16 --no-plots", PAGEDMOE_NO_PROGRESS="1")
    proc = subprocess.run(["bash", "benchmarks/run_all.sh", stage], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    points = json.loads((tmp_path / stage / "sweep.json").read_text())["points"]
    got = {(p["budget_arg"], p["placement"]): p["status"] for p in points}
    assert got == {(b, pl): "ok" for b in ("weights+4", "2") for pl in ("paged", "paged+host-lossless")}
