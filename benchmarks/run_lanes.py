"""Run benchmarks/run_all.sh's stages on every GPU of one machine at once: one lane per GPU.

Every figure of docs/benchmarks.md takes ~75 GPU-minutes (`bash benchmarks/run_all.sh list`), more than
the 30 minutes of device time a session has on one GPU. On a machine with several GPUs the stages run
side by side, each pinned to one GPU (CUDA_VISIBLE_DEVICES), the whole set split into CALLS device
calls of at most BUDGET seconds each (the device tool's limit is 10 minutes a call):

    # the first call probes host->device bandwidth and prints the schedule with the flags for the rest
    run(kind="nvidia-h200-x4", command="python benchmarks/run_lanes.py --calls 2 --call 1")
    run(command="python benchmarks/run_lanes.py --calls 2 --call 2 --pcie-gpus <as call 1 printed>")
    python benchmarks/run_lanes.py --gpus 4 --calls 2 --pcie-gpus 0,1,2,3 --dry-run   # CPU: the schedule only

Scheduling: stages marked [owed] (not yet measured) first, each group longest first, onto the (call, GPU)
bin with the least work so far that still has room in the call's budget; stages no bin has room for are
named, for a later call (--stages ...). Stages marked
[pcie] (expert streaming over PCIe, accelerate offload) only go to GPUs that keep >= 90% of their solo
host->device rate while every GPU copies at once (benchmarks/h2d_probe.py), so their numbers are not
shared-link numbers; each point also records the rate its own copies ran at. Serve stages get their
own port, every engine a host-memory share (HOST_MEMORY_GB: a machine whose memory grows on demand
reports too little MemAvailable at start). A stage that cannot finish before the call's deadline is
not started; the schedule says which. Results: the stages' folders (run_all.sh's layout) in one
archive, $OUT/lanes-call<K>.tgz, and $OUT/lanes-call<K>.txt (schedule, probe, each stage's exit and time).
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
RUN_ALL = ROOT / "benchmarks" / "run_all.sh"


@dataclass(frozen=True)
class Stage:
    name: str
    minutes: float
    pcie: bool
    owed: bool = False   # measures what docs/benchmarks.md does not hold yet: scheduled first


def list_stages() -> list[Stage]:
    """The stages of `run_all.sh list`, in its order: `name  ~N min [pcie] [owed] | what`."""
    text = subprocess.run(["bash", str(RUN_ALL), "list"], capture_output=True, text=True, check=True).stdout
    out = []
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s+~([\d.]+) min( \[pcie\])?( \[owed\])? \|", line)
        if m:
            out.append(Stage(m.group(1), float(m.group(2)), bool(m.group(3)), bool(m.group(4))))
    return out


def schedule(stages: list[Stage], gpus: int, calls: int, pcie_gpus: list[int],
             budget_min: float = float("inf")) -> tuple[list[list[list[Stage]]], list[Stage]]:
    """([call][gpu] -> stages, the stages left out). Owed stages first, each group longest first, each
    stage onto the least loaded bin it may use (PCIe-bound stages only on `pcie_gpus`) whose expected work
    stays within `budget_min`; a stage no bin has room for is left out (for a later call). Ties go to the
    earlier call and the lower GPU, so every call computes the same plan from the same inputs."""
    if any(s.pcie for s in stages) and not pcie_gpus:
        raise ValueError("PCIe-bound stages but no GPU may run them (--pcie-gpus)")
    bins = [[[] for _ in range(gpus)] for _ in range(calls)]
    load = {(c, g): 0.0 for c in range(calls) for g in range(gpus)}
    left_out = []
    for s in sorted(stages, key=lambda s: (not s.owed, -s.minutes)):
        allowed = [k for k in load if (not s.pcie or k[1] in pcie_gpus) and load[k] + s.minutes <= budget_min]
        if not allowed:
            left_out.append(s)
            continue
        c, g = min(allowed, key=lambda k: (load[k], k))
        bins[c][g].append(s)
        load[(c, g)] += s.minutes
    return bins, left_out


def describe(bins, budget_s: float) -> str:
    lines = []
    for c, call in enumerate(bins, 1):
        for g, lane in enumerate(call):
            total = sum(s.minutes for s in lane)
            flag = "  OVER the call's budget" if total * 60 > budget_s else ""
            lines.append(f"call {c} GPU {g}: {total:4.1f} min{flag}: " + ", ".join(s.name for s in lane))
    return "\n".join(lines)


def run_lane(gpu: int, lane: list[Stage], work: Path, deadline: float, host_gb: float, log: list) -> None:
    for s in lane:
        left = deadline - time.time()
        if s.minutes * 60 > left:
            log.append((gpu, s.name, "not started: not enough time left", 0.0))
            continue
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(gpu), OUT=str(work), PORT=str(8000 + gpu),
                   HOST_MEMORY_GB=f"{host_gb:g}", STAGE_TIMEOUT=str(int(min(left - 15, s.minutes * 60 * 1.6 + 60))))
        t0 = time.time()
        with open(work / f"lane{gpu}.log", "a") as f:
            rc = subprocess.run(["bash", str(RUN_ALL), s.name], env=env, stdout=f, stderr=subprocess.STDOUT,
                                cwd=ROOT).returncode
        log.append((gpu, s.name, f"exit {rc}", time.time() - t0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all this machine has)")
    ap.add_argument("--calls", type=int, default=2, help="device calls the stages are split into")
    ap.add_argument("--call", type=int, default=1, help="which of them this is (1-based)")
    ap.add_argument("--budget-s", type=float, default=540, help="seconds this call may run stages for")
    ap.add_argument("--pcie-gpus", default=None, help="GPUs that may run PCIe-bound stages, e.g. 0,2 "
                    "(default: probe; give later calls what the first printed)")
    ap.add_argument("--stages", nargs="*", default=None, help="a subset of run_all.sh's stages (default: all)")
    ap.add_argument("--host-memory-gb", type=float, default=100, help="host tier limit per engine")
    ap.add_argument("--work", default="/tmp/lanes", help="where stages write before the archive")
    ap.add_argument("--dry-run", action="store_true", help="print the schedule and stop (no GPU needed)")
    args = ap.parse_args()
    t_start = time.time()
    stages = list_stages()
    if args.stages:
        known = {s.name: s for s in stages}
        missing = [n for n in args.stages if n not in known]
        if missing:
            sys.exit(f"unknown stages {missing}; `bash benchmarks/run_all.sh list` names them")
        stages = [known[n] for n in args.stages]
    if not 1 <= args.call <= args.calls:
        sys.exit(f"--call must be in 1..{args.calls}")
    # NOTE: this process never touches CUDA (nvidia-smi counts, the probe runs in a child): a context held
    # here would take GPU memory from the stages, whose budgets go up to the whole device.
    gpus = args.gpus
    if gpus is None:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
        gpus = sum(line.startswith("GPU ") for line in listed.splitlines())
        if gpus < 1:
            sys.exit("no GPU: give --gpus N with --dry-run to see the schedule")
    probe = None
    if not args.dry_run:
        # NOTE: a warm machine keeps /tmp between calls: start empty, so this call's archive holds only its
        # own stages
        shutil.rmtree(args.work, ignore_errors=True)
    if args.pcie_gpus is not None:
        pcie = [int(x) for x in args.pcie_gpus.split(",") if x != ""]
    elif args.dry_run:
        pcie = list(range(gpus))
    else:
        probe_json = Path(args.work) / "h2d_probe.json"
        probe_json.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "h2d_probe.py"), "--json", str(probe_json)],
                       check=True)
        probe = json.loads(probe_json.read_text())
        pcie = [g for g in range(gpus) if probe["together_gb_per_s"][g] >= 0.9 * probe["solo_gb_per_s"][g]]
        if not pcie:  # every link is shared: one PCIe-bound stage at a time, on GPU 0
            pcie = [0]
    # the expected minutes are rounded estimates: pack to the call's budget less the runner's own start
    bins, left_out = schedule(stages, gpus, args.calls, pcie, (args.budget_s - 20) / 60)
    header = (f"{len(stages)} stages, {sum(s.minutes for s in stages):.0f} GPU-minutes expected, {gpus} GPUs, "
              f"{args.calls} calls of {args.budget_s:.0f} s; PCIe-bound stages on GPUs {pcie}\n"
              f"later calls: --calls {args.calls} --pcie-gpus {','.join(map(str, pcie))} --gpus {gpus}\n"
              + describe(bins, args.budget_s)
              + (f"\nleft out (no room; run them later with --stages): {' '.join(s.name for s in left_out)}"
                 if left_out else ""))
    print(header, flush=True)
    if args.dry_run:
        return 0
    out = Path(os.environ.get("OUT", "out"))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    deadline = t_start + args.budget_s
    log: list = []
    lanes = bins[args.call - 1]
    threads = [threading.Thread(target=run_lane, args=(g, lane, work, deadline, args.host_memory_gb, log))
               for g, lane in enumerate(lanes) if lane]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report = [header, ""]
    if probe is not None:
        report.append("h2d probe: " + json.dumps(probe))
    report += [f"GPU {g}: {name}: {status} ({secs:.0f} s)" for g, name, status, secs in sorted(log)]
    report.append(f"call {args.call} of {args.calls}: {time.time() - t_start:.0f} s")
    text = "\n".join(report) + "\n"
    (work / f"lanes-call{args.call}.txt").write_text(text)
    (out / f"lanes-call{args.call}.txt").write_text(text)
    with tarfile.open(out / f"lanes-call{args.call}.tgz", "w:gz") as tar:
        tar.add(work, arcname=f"call{args.call}")
    print(text)
    return 0 if all(status == "exit 0" for _, _, status, _ in log) else 1


if __name__ == "__main__":
    raise SystemExit(main())
