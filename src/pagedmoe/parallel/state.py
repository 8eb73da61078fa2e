"""The process's place in the tensor-parallel group, and the collectives the sharded layers call.

One group serves tensor and expert parallelism (vLLM's meaning: `--enable-expert-parallel` splits the
experts over the tensor-parallel ranks instead of splitting each expert). Collectives of the model go
through the default group (NCCL on CUDA, gloo on CPU); the step inputs rank 0 broadcasts go through a
gloo group, so pickled objects never need a device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelState:
    world_size: int = 1
    rank: int = 0
    expert_parallel: bool = False
    torchrun: bool = False  # launched by torchrun (every rank runs the user's script)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def ep_size(self) -> int:
        return self.world_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.rank if self.expert_parallel else 0


_STATE = ParallelState()
_CONTROL: Optional[object] = None  # the gloo group of the step broadcasts


def get_state() -> ParallelState:
    return _STATE


def set_state(state: ParallelState, control=None) -> None:
    global _STATE, _CONTROL
    _STATE, _CONTROL = state, control


def control_group():
    return _CONTROL


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of the ranks' partial results (row-parallel outputs), in place; the identity on one rank."""
    if _STATE.world_size > 1:
        dist.all_reduce(x)
    return x


def all_reduce_min(value: int) -> int:
    """The smallest of the ranks' integers (the KV blocks every rank can hold)."""
    if _STATE.world_size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL)
    return int(t[0])
