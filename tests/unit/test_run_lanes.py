"""benchmarks/run_lanes.py: run_all.sh's stage list parses; the queue's plan places every stage once, PCIe-bound
stages only on the GPUs allowed them; live calls against a stand-in run_all.sh share one queue across calls."""
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
    assert {"gputests", "glm-air", "serve-paged", "latency", "throughput-mixtral", "hf-offload-24", "sweep-mixtral-w4-resident,paged,paged+lossless"} <= set(names)
    assert all(s.minutes > 0 for s in stages)
    assert {s.name for s in stages if s.pcie} >= {"glm-air", "sweep-mixtral-24-paged", "hf-offload-24", "hf-offload-64"}
    assert not any(s.pcie for s in stages if s.name in ("codec", "gputests", "sweep-qwen3-139-resident"))
    # [owed] marks what docs/benchmarks.md lacks, so the set changes with the results: parsed, not fixed here
    text = subprocess.run(["bash", str(run_lanes.RUN_ALL), "list"], capture_output=True, text=True).stdout
    marked = {line.split()[0] for line in text.splitlines() if "[owed]" in line.split("|")[0]}
    assert {s.name for s in stages if s.owed} == marked


def test_run_all_exits_with_the_stage_status(tmp_path):
    """run_lanes.py tells a stage cut at its deadline (124) from a failure by run_all.sh's exit status."""
    import os
    proc = subprocess.run(["bash", str(run_lanes.RUN_ALL), "no-such-stage"], capture_output=True, text=True,
                          env=dict(os.environ, OUT=str(tmp_path)))
    assert proc.returncode == 2 and "unknown stage no-such-stage" in proc.stdout


def test_pick_takes_owed_then_longest_that_fits_and_may_run_here():
    stages = [run_lanes.Stage("a", 5.0, False), run_lanes.Stage("b", 1.0, False, True),
              run_lanes.Stage("c", 3.0, False), run_lanes.Stage("p", 4.0, True)]
    assert run_lanes.pick(stages, 0, [0], 600).name == "b"      # owed first
    rest = [s for s in stages if not s.owed]
    assert run_lanes.pick(rest, 0, [0], 600).name == "a"        # then the longest
    assert run_lanes.pick(rest, 0, [0], 270).name == "p"        # a (300 s) does not fit
    assert run_lanes.pick(rest, 1, [0], 270).name == "c"        # GPU 1 may not stream over PCIe
    assert run_lanes.pick(rest, 0, [0], 100) is None


def test_plan_runs_owed_first_and_keeps_each_call_within_its_budget():
    stages = [run_lanes.Stage("a", 5.0, False), run_lanes.Stage("b", 1.0, False, True),
              run_lanes.Stage("c", 3.0, False)]
    bins, later = run_lanes.plan(stages, 1, 1, [0], 4 * 60 + run_lanes.START_S + run_lanes.CUT_MARGIN_S)
    assert [s.name for s in bins[0][0]] == ["b", "c"] and [s.name for s in later] == ["a"]


@pytest.mark.parametrize("gpus,calls,pcie", [(4, 2, [0, 1, 2, 3]), (8, 1, [0, 2, 4, 6]), (1, 3, [0]), (2, 2, [1])])
def test_plan_places_each_stage_once_pcie_where_allowed(gpus, calls, pcie):
    stages = run_lanes.list_stages()
    budget_s = 3600 * 4
    bins, later = run_lanes.plan(stages, gpus, calls, pcie, budget_s)
    assert later == []
    placed = [(c, g, s) for c, call in enumerate(bins) for g, lane in enumerate(call) for s in lane]
    assert sorted(s.name for _, _, s in placed) == sorted(s.name for s in stages)
    assert all(g in pcie for _, g, s in placed if s.pcie)
    assert (bins, later) == run_lanes.plan(stages, gpus, calls, pcie, budget_s)   # deterministic
    loads = [sum(s.minutes for s in lane) for lane in bins[0]]
    # longest first onto the earliest free GPU: no GPU ends later than the average by more than the longest
    if len(pcie) == gpus:
        assert max(loads) <= sum(loads) / len(loads) + max(s.minutes for s in stages)


def test_plan_of_the_real_stages_fits_each_call():
    stages = run_lanes.list_stages()
    budget_s = 545
    bins, later = run_lanes.plan(stages, 2, 3, [0, 1], budget_s)
    room = (budget_s - run_lanes.START_S - run_lanes.CUT_MARGIN_S) / 60
    assert all(sum(s.minutes for s in lane) <= room for call in bins for lane in call)
    placed = [s for call in bins for lane in call for s in lane]
    assert sorted(s.name for s in placed + later) == sorted(s.name for s in stages)


def test_plan_refuses_pcie_stages_without_pcie_gpus():
    with pytest.raises(ValueError, match="--pcie-gpus"):
        run_lanes.plan(run_lanes.list_stages(), 2, 1, [], 540)


FAKE_RUN_ALL = r"""#!/usr/bin/env bash
# a stand-in for run_all.sh: `list`, and a stage that records its GPU and sleeps
case $1 in
  list) cat <<'LIST'
big        ~0.1 min | long
pcie       ~0.05 min [pcie] | streams
small      ~0.025 min | short
huge       ~0.175 min | too long for the first call
slow       ~0.005 min | runs into the deadline the first time
LIST
  ;;
  *) mkdir -p "$OUT/$1"; echo "gpu=$CUDA_VISIBLE_DEVICES timeout=$STAGE_TIMEOUT" > "$OUT/$1/ran.txt"
     if [ "$1" = slow ] && [ ! -e "$MARK" ]; then touch "$MARK"; timeout "$STAGE_TIMEOUT" sleep 300; exit $?; fi
     sleep 0.2 ;;
esac
"""


def test_lanes_run_a_series_of_calls_from_one_queue(tmp_path):
    """Live runs against a stand-in run_all.sh: two lanes share the queue; what does not fit waits for the
    next call, a stage cut at the deadline is run again there, and each call's archive holds its stages."""
    import json
    import os
    import tarfile

    fake = tmp_path / "run_all.sh"
    fake.write_text(FAKE_RUN_ALL)
    env = dict(os.environ, RUN_ALL=str(fake), MARK=str(tmp_path / "mark"))

    def call(k, budget, out):
        return subprocess.run([sys.executable, str(Path(run_lanes.__file__)), "--gpus", "2", "--pcie-gpus", "1",
                               "--call", str(k), "--budget-s", str(budget), "--work", str(tmp_path / "work"),
                               "--state", str(tmp_path / "state.json")],
                              env=dict(env, OUT=str(out)), capture_output=True, text=True, timeout=120)

    # 38 s: 8 s of stages before the cut margin (CUT_MARGIN_S, 30 s), which "slow" sleeps through to its cut
    first = call(1, 38, tmp_path / "out1")
    assert "left for the next call (--call 2)" in first.stdout, first.stdout + first.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    assert set(state["ran"]) == {"big", "pcie", "small"} and set(state["cut"]) == {"slow"}
    assert state["ran"]["pcie"]["gpu"] == 1
    with tarfile.open(tmp_path / "out1" / "lanes-call1.tgz") as tar:
        names = tar.getnames()
    assert {"call1/big/ran.txt", "call1/pcie/ran.txt", "call1/lanes-call1.txt"} <= set(names)
    assert "call1/huge/ran.txt" not in names
    assert "slow: cut at the call's deadline" in (tmp_path / "out1" / "lanes-call1.txt").read_text()

    second = call(2, 60, tmp_path / "out2")
    assert second.returncode == 0 and "all done" in second.stdout, second.stdout + second.stderr
    state = json.loads((tmp_path / "state.json").read_text())
    assert {k: v["call"] for k, v in state["ran"].items()} == {"big": 1, "pcie": 1, "small": 1, "huge": 2,
                                                               "slow": 2}
    with tarfile.open(tmp_path / "out2" / "lanes-call2.tgz") as tar:
        assert {"call2/huge/ran.txt", "call2/slow/ran.txt"} <= set(tar.getnames())
        assert "call2/big/ran.txt" not in tar.getnames()

    lost = subprocess.run([sys.executable, str(Path(run_lanes.__file__)), "--gpus", "2", "--call", "3",
                           "--state", str(tmp_path / "none.json")], env=env, capture_output=True, text=True)
    assert lost.returncode != 0 and "no state from earlier calls" in lost.stderr


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


def test_run_all_glm_stage_runs_the_sweep_workload(tmp_path):
    """The glm-air stage goes through the sweeps' own flags (--num-prompts among them: left at the sweep's
    default, 64, it once capped GLM-4.5-Air's batch at 64 of 141 sequences): on the CPU with the embedded
    model standing in, the batch is SWEEP_NUM_PROMPTS and the host tier is bounded by HOST_MEMORY_GB."""
    import json
    import os

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OUT=str(tmp_path), GLM_MODEL="src/pagedmoe/default_model", SWEEP_STEADY_STEPS="1",
               SWEEP_INPUT_LEN="8", SWEEP_OUTPUT_LEN="8", SWEEP_MAX_MODEL_LEN="32", SWEEP_NUM_PROMPTS="3",
               SWEEP_EXTRA="--dtype bfloat16 --no-plots", PAGEDMOE_NO_PROGRESS="1", HOST_MEMORY_GB="2")
    proc = subprocess.run(["bash", "benchmarks/run_all.sh", "glm-air"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sweep = json.loads((tmp_path / "glm-air" / "sweep.json").read_text())
    (point,) = sweep["points"]
    assert point["status"] == "ok" and point["placement"] == "paged+lossless"
    assert point["num_requests"] == 3 and sweep["config"]["num_prompts"] == 3
    assert sweep["config"]["engine"]["host_memory_gb"] == 2.0
