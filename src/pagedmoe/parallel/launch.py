"""Start the ranks of a tensor-parallel engine and run the workers' side of each step.

Two launches, one control plane (the scheduler, the KV block tables and sampling on rank 0):
- `--tensor-parallel-size N` in one process (`pagedmoe serve/generate/bench`, `LLM(...)`): that process is
  rank 0 and starts ranks 1..N-1 (fresh interpreters, parallel/worker.py), which meet it on a free
  localhost port;
- `torchrun --nproc-per-node N script.py` (RANK / WORLD_SIZE / MASTER_ADDR set): every rank runs the
  script; `LLM(...)` returns on rank 0 and, on the others, serves rank 0's steps and exits the process
  when rank 0 shuts down (its script past `LLM(...)` never runs there). A worker rank ends with `os._exit`
  after flushing its streams and logs (exit_worker): the interpreter's teardown could otherwise destroy
  gloo's C++ objects while their threads still run and abort the rank ("terminate called without an
  active exception"), which torchrun reports as a failed launch.
Start-up runs on every rank alike (each builds its shard, plans its budget, profiles, and the ranks agree
on the smallest KV block count), so the collectives inside it meet. Then each step rank 0 broadcasts the
step's host inputs (worker/model_runner.py::host_inputs) over a gloo group and every rank runs the same
forward; rank 0 alone samples (its LM head is whole: the embedding and LM head are replicated).
"""
from __future__ import annotations

import atexit
import base64
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from pagedmoe.parallel.state import ParallelState, control_group, get_state, set_state

logger = logging.getLogger("pagedmoe")
# NVLink multicast (NVLS) stays off in every rank: the machines this runs on do not support it reliably
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
_TIMEOUT = timedelta(minutes=30)  # a collective of the model (a rank that died ends the others by then)
# a worker waits for rank 0's next step over the control group: an idle server may send none for days
_IDLE_TIMEOUT = timedelta(days=365)


def _backend(device_name: str) -> str:
    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_parallel(config) -> ParallelState:
    """Join (or create) this process's tensor-parallel group for `config`; the identity for one rank."""
    global _TORCHRUN_JOINED
    n, ep = config.tensor_parallel_size, config.enable_expert_parallel
    state = get_state()
    if n > 1 and _TORCHRUN_JOINED:
        # the other ranks served the first engine and exit with it: a second group would wait for them forever
        raise ValueError("under torchrun a script runs one tensor-parallel engine (the other ranks exit when it "
                         "shuts down): create LLM(...) once per launch")
    if state.enabled and state.rank == 0 and not state.torchrun and _LIVE:
        # a second engine in this process (bench sweep): the previous engine's workers end first
        _LIVE[-1].close()
        state = get_state()
    if state.enabled:  # a spawned worker (joined before start-up) or an engine started before in this process
        if state.world_size != n:
            raise ValueError(f"this process already runs a tensor-parallel group of {state.world_size} ranks")
        return state
    if n == 1:
        return state
    backend = _backend(config.device)
    os.environ.update(NCCL_ENV)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
        if world != n:
            raise ValueError(f"--tensor-parallel-size {n} but torchrun started {world} processes")
        _init(backend, rank, world, "env://", int(os.environ.get("LOCAL_RANK", rank)))
        state = ParallelState(world, rank, ep, torchrun=True)
        _TORCHRUN_JOINED = True
    else:
        port = _free_port()
        _SPAWNED[:] = [_spawn_worker(config, rank, port) for rank in range(1, n)]
        _init(backend, 0, n, f"tcp://127.0.0.1:{port}", 0)
        state = ParallelState(n, 0, ep)
    set_state(state, dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT))
    logger.info("tensor parallel: rank %d of %d (%s)%s", state.rank, n, backend,
                ", experts split over the ranks" if ep else "")
    return state


def _spawn_worker(config, rank: int, port: int) -> subprocess.Popen:
    """A fresh interpreter running parallel/worker.py (not multiprocessing's spawn: that re-imports the
    user's main module, so a script without an `if __name__ == "__main__"` guard would start again), which
    ends itself when this process dies (watch_parent)."""
    env = dict(os.environ, **NCCL_ENV, PAGEDMOE_NO_PROGRESS="1", PAGEDMOE_TP_PARENT=str(os.getpid()),
               PAGEDMOE_TP_CONFIG=base64.b64encode(pickle.dumps(config)).decode())
    return subprocess.Popen([sys.executable, "-m", "pagedmoe.parallel.worker", str(rank), str(port)], env=env,
                            stdin=subprocess.DEVNULL)


def watch_parent(pid: int, interval_s: float = 0.5) -> None:
    """A spawned rank ends when rank 0's process (`pid`) is gone. Not PR_SET_PDEATHSIG: that fires when the
    *thread* that started the rank ends, so an LLM(...) built in a thread pool would lose its ranks with it."""
    def watch() -> None:
        while os.getppid() == pid:
            time.sleep(interval_s)
        logger.error("tensor parallel: rank 0 (pid %d) is gone; this rank exits", pid)
        exit_worker(1)

    threading.Thread(target=watch, name="pagedmoe-watch-rank0", daemon=True).start()


def _init(backend: str, rank: int, world: int, init_method: str, local_rank: int) -> None:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=_TIMEOUT)


def join_group(config, rank: int, port: int) -> None:
    """A spawned rank (parallel/worker.py) joins rank 0's group before it starts the same engine."""
    n = config.tensor_parallel_size
    _init(_backend(config.device), rank, n, f"tcp://127.0.0.1:{port}", rank)
    set_state(ParallelState(n, rank, config.enable_expert_parallel),
              dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT))


def serve_steps(parts) -> None:
    """A worker's loop: run each step rank 0 broadcasts, until it sends the end (None)."""
    runner, activity, pager = parts.runner, parts.activity, parts.model.pager
    while True:
        box: list[Optional[dict]] = [None]
        dist.broadcast_object_list(box, src=0, group=control_group())
        if box[0] is None:
            break
        runner.execute_host(box[0])
        activity.end_step()
        if pager is not None:
            if parts.device.type == "cuda":  # rank 0 waits for its sample; a worker for its forward
                torch.cuda.synchronize()
            pager.end_step()
    dist.destroy_process_group()


def exit_worker(code: int = 0) -> None:
    """End a worker rank's process once its group is gone: flush what it printed and logged, then skip the
    interpreter's teardown (see the module docstring)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


_LIVE: list = []  # rank 0's StepBroadcast while its workers run
_SPAWNED: list = []  # rank 0's Popen of ranks 1..N-1 (none under torchrun)
_TORCHRUN_JOINED = False  # this process joined torchrun's group (once: its other ranks end with that engine)


class StepBroadcast:
    """Rank 0's side: ModelRunner.execute sends each step's host inputs; close() ends the workers."""

    def __init__(self) -> None:
        self.open = True
        self.workers = list(_SPAWNED)
        _LIVE[:] = [self]
        atexit.register(self.close)

    def check(self) -> None:
        """RuntimeError when a spawned rank has exited: no step can run without it (LLMEngine.check_health)."""
        for rank, proc in enumerate(self.workers, 1):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {proc.returncode}")

    def send(self, host: dict) -> None:
        if not self.open:
            raise RuntimeError("this engine's tensor-parallel workers were shut down (a later engine in this "
                               "process replaced them)")
        self.check()
        dist.broadcast_object_list([host], src=0, group=control_group())

    def close(self) -> None:
        """End the workers' loops and leave the group (a later engine in this process starts a new one)."""
        if self.open and dist.is_initialized():
            self.open = False
            try:
                dist.broadcast_object_list([None], src=0, group=control_group())
            except RuntimeError as e:  # a rank has died: the others' next collective fails and they exit
                logger.warning("tensor parallel: not every rank heard the shutdown (%s)", str(e).splitlines()[0])
            dist.destroy_process_group()
            set_state(ParallelState())
            _LIVE.clear()
            for proc in self.workers:  # reaped, not left as zombies while this process lives on
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    logger.warning("tensor parallel: rank pid %d did not exit within 10 s", proc.pid)


def abandon_group(state: ParallelState) -> None:
    """Rank 0's start-up failed: leave the group so that the workers' collectives fail and they exit."""
    if state.enabled and state.rank == 0 and dist.is_initialized():
        dist.destroy_process_group()
        set_state(ParallelState())


def finish_start(parts) -> None:
    """After start-up: rank 0's runner broadcasts its steps; under torchrun another rank serves them here and
    exits the process when rank 0 is done."""
    state = get_state()
    if not state.enabled:
        return
    if state.rank == 0:
        parts.runner.control = StepBroadcast()
    elif state.torchrun:
        serve_steps(parts)
        exit_worker()
