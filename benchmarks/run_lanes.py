"""Run benchmarks/run_all.sh's stages on every GPU of one machine at once: one lane per GPU.

Every figure of docs/benchmarks.md takes ~50 GPU-minutes (`bash benchmarks/run_all.sh list`), more than
the 30 minutes of device time a session has on one GPU. On a machine with several GPUs the stages run
side by side, each pinned to one GPU (CUDA_VISIBLE_DEVICES), over as many device calls of at most
BUDGET seconds as they need (the device tool's limit is 10 minutes a call). Every call is the same
command; the first (--call 1) starts a new series, later ones run what the earlier ones left:

    run(kind="nvidia-h200-x2", carry=[".whl"], command="python benchmarks/run_lanes.py --call 1 --budget-s 540")
    run(command="python benchmarks/run_lanes.py --call 2 --budget-s 540")   # ... until it prints "all done"
    python benchmarks/run_lanes.py --gpus 2 --calls 3 --budget-s 540 --dry-run   # CPU: the expected plan

Scheduling is a queue: whenever a GPU is free it takes the longest stage left (stages marked [owed], not
yet measured, before the rest) that it may run and whose expected time fits before the call's deadline;
a stage still running at the deadline is cut (STAGE_TIMEOUT) so the call returns whole. What each call
ran is kept in a state file (--state, under /tmp: a warm machine keeps /tmp between calls), so the next
call takes up the rest; a fresh machine has none, and then a later call refuses to guess (--stages names
what is left). Stages marked [pcie] (expert streaming over PCIe, accelerate offload) only go to GPUs that
keep >= 90% of their solo host->device rate while every GPU copies at once (benchmarks/h2d_probe.py, run
by the first call), so their numbers are not shared-link numbers; each point also records the rate its own
copies ran at. Serve stages get their own port, every engine a host-memory share (HOST_MEMORY_GB: a
machine whose memory grows on demand reports too little MemAvailable at start). Results: the stages'
folders (run_all.sh's layout) in one archive per call, $OUT/lanes-call<K>.tgz (rewritten after every
stage, so a call cut short still returns what finished), and $OUT/lanes-call<K>.txt (plan, probe, each
stage's exit and time).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN_ALL = Path(os.environ.get("RUN_ALL", ROOT / "benchmarks" / "run_all.sh"))
START_S = 20        # the runner's own start (and the probe's) before the first stage, in the plan
# a stage is cut this long before the call's deadline: run_all.sh's `timeout --kill-after=15` may take 15 s
# more for a stage that ignores SIGTERM, and the archive must still be written
CUT_MARGIN_S = 30


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float
    pcie: bool
    owed: bool = False   # measures what docs/benchmarks.md does not hold yet: taken first


def list_stages() -> list[Stage]:
    """The stages of `run_all.sh list`, in its order: `name  ~N min [pcie] [owed] | what`."""
    text = subprocess.run(["bash", str(RUN_ALL), "list"], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s+~([\d.]+) min( \[pcie\])?( \[owed\])? \|", line)
        if m:
            out.append(Stage(m.group(1), float(m.group(2)), bool(m.group(3)), bool(m.group(4))))
    return out


def pick(left: list[Stage], gpu: int, pcie_gpus: list[int], seconds_left: float) -> Stage | None:
    """The stage a free GPU takes next: owed first, then the longest, among those it may run (PCIe-bound
    only on `pcie_gpus`) that are expected to finish in `seconds_left`. Ties: run_all.sh's order."""
    fits = [s for s in left if (not s.pcie or gpu in pcie_gpus) and s.minutes * 60 <= seconds_left]
    return min(fits, key=lambda s: (not s.owed, -s.minutes), default=None)


def plan(stages: list[Stage], gpus: int, calls: int, pcie_gpus: list[int], budget_s: float
         ) -> tuple[list[list[list[Stage]]], list[Stage]]:
    """What the queue does if every stage takes its expected time: ([call][gpu] -> stages, stages left for
    later calls). Each call, the GPU whose clock is earliest picks next (lowest GPU on ties)."""
    if any(s.pcie for s in stages) and not pcie_gpus:
        raise ValueError("PCIe-bound stages but no GPU may run them (--pcie-gpus)")
    left = list(stages)
    bins = []
    for _ in range(calls):
        lanes: list[list[Stage]] = [[] for _ in range(gpus)]
        clock = {g: float(START_S) for g in range(gpus)}
        while clock:
            g = min(clock, key=lambda k: (clock[k], k))
            s = pick(left, g, pcie_gpus, budget_s - CUT_MARGIN_S - clock[g])
            if s is None:
                del clock[g]
                continue
            left.remove(s)
            lanes[g].append(s)
            clock[g] += s.minutes * 60
        bins.append(lanes)
    return bins, left


def describe(bins) -> str:
    return "\n".join(f"call {c} GPU {g}: {sum(s.minutes for s in lane):4.1f} min: "
                     + ", ".join(s.name for s in lane)
                     for c, call in enumerate(bins, 1) for g, lane in enumerate(call))


class Queue:
    """The stages left, shared by the lanes of one call; records what ran in the state file."""

    def __init__(self, left: list[Stage], pcie_gpus: list[int], deadline: float, state: dict, state_path: Path,
                 archive) -> None:
        self.left, self.pcie, self.deadline = list(left), pcie_gpus, deadline
        self.state, self.state_path, self.archive = state, state_path, archive
        self.lock = threading.Lock()

    def take(self, gpu: int) -> Stage | None:
        with self.lock:
            s = pick(self.left, gpu, self.pcie, self.deadline - CUT_MARGIN_S - time.time())
            if s is not None:
                self.left.remove(s)
            return s

    def finished(self, gpu: int, s: Stage, rc: int, secs: float, deadline_cut_s: int | None) -> None:
        """Record a stage's end. A stage cut at the call's deadline (`deadline_cut_s`: its STAGE_TIMEOUT, when
        that came from the deadline) is left for the next call, which runs it from the start."""
        with self.lock:
            cut = deadline_cut_s is not None and rc in (124, 137) and secs >= deadline_cut_s - 2
            record = {"call": self.state["call"], "gpu": gpu, "seconds": round(secs, 1),
                      "status": "cut at the call's deadline: left for the next call" if cut else f"exit {rc}"}
            self.state["cut" if cut else "ran"][s.name] = record
            save_state(self.state_path, self.state)
            self.archive()


def run_lane(gpu: int, queue: Queue, work: Path, host_gb: float) -> None:
    while (s := queue.take(gpu)) is not None:
        by_deadline = int(max(1, queue.deadline - CUT_MARGIN_S - time.time()))
        hung = int(s.minutes * 60 * 1.6 + 60)   # far past its expected time: a hang, not a cut
        timeout_s = min(by_deadline, hung)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), OUT=str(work), PORT=str(8000 + gpu),
                   HOST_MEMORY_GB=f"{host_gb:g}", STAGE_TIMEOUT=str(timeout_s))
        t0 = time.time()
        with open(work / f"lane{gpu}.log", "a") as f:
            rc = subprocess.run(["bash", str(RUN_ALL), s.name], env=env, stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT).returncode
        queue.finished(gpu, s, rc, time.time() - t0, by_deadline if by_deadline <= hung else None)


def load_state(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def save_state(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1))
    tmp.replace(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all this machine has)")
    ap.add_argument("--call", type=int, default=1,
                    help="1 starts a new series; K > 1 runs what calls 1..K-1 left (read from --state)")
    ap.add_argument("--calls", type=int, default=3, help="--dry-run: how many calls to plan")
    ap.add_argument("--budget-s", type=float, default=540, help="seconds this call may run stages for")
    ap.add_argument("--pcie-gpus", default=None, help="GPUs that may run PCIe-bound stages, e.g. 0,2 "
                    "(default: the first call probes; later calls reuse what it found)")
    ap.add_argument("--stages", nargs="*", default=None, help="a subset of run_all.sh's stages (default: all)")
    ap.add_argument("--host-memory-gb", type=float, default=100, help="host tier limit per engine")
    ap.add_argument("--work", default="/tmp/lanes", help="where stages write before the archive")
    ap.add_argument("--state", default="/tmp/lanes-state.json", help="what earlier calls of the series ran")
    ap.add_argument("--dry-run", action="store_true", help="print the expected plan and stop (no GPU needed)")
    args = ap.parse_args()
    t_start = time.time()
    stages = list_stages()
    if args.stages:
        known = {s.name: s for s in stages}
        missing = [n for n in args.stages if n not in known]
        if missing:
            sys.exit(f"unknown stages {missing}; `bash benchmarks/run_all.sh list` names them")
        stages = [known[n] for n in args.stages]
    state_path = Path(args.state)
    if args.dry_run or args.call == 1:
        state = {"call": args.call, "ran": {}, "cut": {}, "pcie_gpus": None, "stages": [s.name for s in stages]}
    else:
        state = load_state(state_path)
        if state is None:
            sys.exit(f"--call {args.call}: no state from earlier calls in {state_path} (a fresh machine?); "
                     f"start a new series with --call 1, or give --stages for what is left")
        if args.stages is None:
            names = set(state.get("stages", []))
            stages = [s for s in stages if s.name in names]
        state["call"] = args.call
        state["cut"] = {}
    stages = [s for s in stages if s.name not in state["ran"]]
    # NOTE: this process never touches CUDA (nvidia-smi counts, the probe runs in a child): a context held
    # here would take GPU memory from the stages, whose budgets go up to the whole device.
    gpus = args.gpus
    if gpus is None:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
        if gpus < 1:
            sys.exit("no GPU: give --gpus N with --dry-run to see the plan")
    work = Path(args.work)
    if not args.dry_run:
        # NOTE: a warm machine keeps /tmp between calls: start empty, so this call's archive holds only its
        # own stages
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
    probe = None
    if args.pcie_gpus is not None:
        pcie = [int(x) for x in args.pcie_gpus.split(",") if x != ""]
    elif state.get("pcie_gpus") is not None:
        pcie = state["pcie_gpus"]
    elif args.dry_run:
        pcie = list(range(gpus))
    else:
        probe_json = work / "h2d_probe.json"
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h2d_probe.py"), "--json", str(probe_json)],
                       check=True)
        probe = json.loads(probe_json.read_text())
        pcie = [g for g in range(gpus) if probe["together_gb_per_s"][g] >= 0.9 * probe["solo_gb_per_s"][g]]
        if not pcie:  # every link is shared: one PCIe-bound stage at a time, on GPU 0
            pcie = [0]
    state["pcie_gpus"] = pcie
    bins, later = plan(stages, gpus, args.calls if args.dry_run else 1, pcie, args.budget_s)
    header = (f"call {args.call}: {len(stages)} stages left, {sum(s.minutes for s in stages):.0f} GPU-minutes "
              f"expected, {gpus} GPUs, {args.budget_s:.0f} s a call; PCIe-bound stages on GPUs {pcie}\n"
              + ("expected plan:\n" if args.dry_run else "expected this call:\n") + describe(bins)
              + (f"\nleft for later calls: {' '.join(s.name for s in later)}" if later else ""))
    print(header, flush=True)
    if args.dry_run:
        return 0
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / f"lanes-call{args.call}.txt"

    tail: list[str] = []

    def report() -> str:
        lines = [header, ""] + (["h2d probe: " + json.dumps(probe)] if probe is not None else [])
        records = [(r["gpu"], name, r) for kind in ("ran", "cut") for name, r in state[kind].items()
                   if r["call"] == args.call]
        lines += [f"GPU {g}: {name}: {r['status']} ({r['seconds']:.0f} s)" for g, name, r in sorted(records)]
        return "\n".join(lines + tail) + "\n"

    def archive() -> None:
        report_path.write_text(report())
        shutil.copy(report_path, work / report_path.name)
        with tarfile.open(out / f"lanes-call{args.call}.tgz", "w:gz") as tar:
            tar.add(work, arcname=f"call{args.call}")

    save_state(state_path, state)
    queue = Queue(stages, pcie, t_start + args.budget_s, state, state_path, archive)
    threads = [threading.Thread(target=run_lane, args=(g, queue, work, args.host_memory_gb)) for g in range(gpus)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = [s.name for s in stages if s.name not in state["ran"]]
    tail.append(f"call {args.call}: {time.time() - t_start:.0f} s; "
                + (f"left for the next call (--call {args.call + 1}): {' '.join(left)}" if left else "all done"))
    archive()
    print(report(), end="")
    ran = [r for r in state["ran"].values() if r["call"] == args.call]
    return 0 if all(r["status"] == "exit 0" for r in ran) else 1


if __name__ == "__main__":
    raise SystemExit(main())
