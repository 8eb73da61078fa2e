"""Pieces the offline benchmarks share: engine flags, random token prompts, environment record."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional

from pagedmoe.config import add_engine_args, engine_config_from_args


def add_offline_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--output-json", default=None, help="write the result and configuration as JSON here")
    add_engine_args(p)


def make_engine(args):
    from pagedmoe.engine.llm_engine import LLMEngine

    config = engine_config_from_args(args, model=args.model)
    return LLMEngine(config), dataclasses.asdict(config)


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids (never special ids 0-9), like vLLM's random dataset."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    low = min(10, vocab_size - 1)
    return torch.randint(low, vocab_size, (num, length), generator=gen).tolist()


def device_memory(engine, budget_bytes: Optional[int] = None) -> dict:
    """What the process held on the device (GiB, worker/device_memory.py): now, its peak since the engine
    started (the driver's count, polled: CUDA context, torch's pool, VMM mappings), torch's peak reservation,
    the start-up stages, the budget, and the KV memory lent to experts at the end."""
    mon = getattr(engine, "memory", None)
    if mon is None:
        return {}
    import torch

    from pagedmoe.planning.kv_sizing import GiB

    torch.cuda.synchronize(engine.device)
    out = mon.record(budget_bytes or engine.plan.budget_bytes)
    kv = engine.runner.kv_backing
    if kv is not None:
        out["kv_lent_to_experts_at_end_gib"] = kv.lent_bytes / GiB
    return out
