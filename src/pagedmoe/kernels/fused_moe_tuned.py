"""Tuned tile tables of the fused MoE kernels, per (expert shape, batch), as benchmarks/tune_fused_moe.py
measures them on one GPU model; kernels/fused_moe.py's default_config is the fallback.

A table is one JSON file per (device name, dtype), in pagedmoe/data/ (shipped with the package) as
``fused_moe_<device>_<dtype>.json`` (device name with anything but [A-Za-z0-9] as "_", e.g.
fused_moe_NVIDIA_H200_bfloat16.json), or the file named by PAGEDMOE_FUSED_MOE_CONFIG (``off``: no table):

    {"device": "NVIDIA H200", "dtype": "bfloat16", "commit": "...", "triton": "3.6.0",
     "shapes": {"E=128,H=2048,I=768,A=8": {"1": {"block_m": 16, ...FusedMoEConfig fields}, "64": {...}}}}

A step of T tokens takes the entry of the smallest tuned batch b >= T if b <= 2T: tiles tuned for a batch suit
the sizes just below it, and padding rows only cost MMA work. Otherwise default_config: past the largest tuned
batch (tiles for 8 tokens would starve a 256-token step) and in a gap (a table of 256 and 512 only must not
hand 256's tiles to one token). A shape the table lacks, a
device without a table, or float32 (the interpreter's small tiles) fall back to default_config. A table
that does not parse raises ValueError naming the file, once, at its first use.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import os
import re
from pathlib import Path
import torch

ENV = "PAGEDMOE_FUSED_MOE_CONFIG"
DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def shape_key(num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    return f"E={num_experts},H={hidden},I={inter},A={top_k}"


def table_name(device_name: str, dtype: torch.dtype) -> str:
    return f"fused_moe_{re.sub(r'[^A-Za-z0-9]+', '_', device_name).strip('_')}_{str(dtype).removeprefix('torch.')}.json"


def parse_table(text: str, source: str) -> dict[str, list[tuple[int, object]]]:
    """JSON text -> {shape key: [(batch, FusedMoEConfig)] sorted by batch}; ValueError names the source."""
    from pagedmoe.kernels.fused_moe_config import FusedMoEConfig

    fields = {f.name for f in dataclasses.fields(FusedMoEConfig)}
    try:
        raw = json.loads(text)
        shapes = raw["shapes"]
        out = {}
        for key, per_batch in shapes.items():
            entries = []
            for batch, cfg in per_batch.items():
                unknown = set(cfg) - fields
                if unknown:
                    raise ValueError(f"unknown FusedMoEConfig fields {sorted(unknown)}")
                entries.append((int(batch), FusedMoEConfig(**cfg)))
            if not entries:
                raise ValueError(f"shape {key} has no batches")
            out[key] = sorted(entries, key=lambda e: e[0])
        return out
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"fused MoE config table {source} is malformed: {e}") from None


@functools.lru_cache(maxsize=None)
def load_table(device_name: str, dtype: torch.dtype) -> dict:
    """The table for this device and dtype ({} when there is none); cached, so it is read once."""
    env = os.environ.get(ENV)
    if env == "off":
        return {}
    path = Path(env) if env else DATA_DIR / table_name(device_name, dtype)
    if not path.exists():
        if env:
            raise ValueError(f"{ENV}={env}: no such file")
        return {}
    return parse_table(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@functools.lru_cache(maxsize=4096)
def _lookup(device_name: str, dtype: torch.dtype, key: str, num_tokens: int):
    entries = load_table(device_name, dtype).get(key)
    if not entries:
        return None
    batches = [b for b, _ in entries]
    i = bisect.bisect_left(batches, num_tokens)
    return entries[i][1] if i < len(entries) and batches[i] <= 2 * num_tokens else None


def tuned_config(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype,
                 device: torch.device):
    """The tuned FusedMoEConfig for this step, or None (then default_config). Host work only, memoised."""
    if dtype == torch.float32:
        return None
    return _lookup(_device_name(device), dtype, shape_key(num_experts, hidden, inter, top_k), num_tokens)


def clear_cache() -> None:
    """Forget loaded tables (tests, or after writing a new one)."""
    load_table.cache_clear()
    _lookup.cache_clear()
