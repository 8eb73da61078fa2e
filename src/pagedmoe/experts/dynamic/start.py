"""Start-up of `--expert-precision dynamic` and `--expert-stats`: the activity file, the manager."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Optional

from pagedmoe.experts.dynamic.manager import DynamicPrecisionManager, parse_state
from pagedmoe.experts.dynamic.offline import OfflineForms
from pagedmoe.experts.dynamic.precision import LADDER, rung_index

logger = logging.getLogger(__name__)


def prepare_expert_stats_path(path: Optional[str]) -> None:
    """--expert-stats PATH, before the model loads: its folder is made (as --output-json's), and a path the exit
    could not write is refused now rather than warned about after the whole run."""
    if not path:
        return
    file = Path(path)
    if file.is_dir():
        raise ValueError(f"--expert-stats {path} is a folder; give the path of a JSON file")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        if file.exists():
            open(file, "a").close()       # opened for writing, left as it is (it is loaded next)
        else:
            open(file, "x").close()       # a probe: removed at once, so the first run still starts fresh
            file.unlink()
    except OSError as e:
        raise ValueError(f"--expert-stats {path} cannot be written, so the stats could not be saved at exit "
                         f"({e.strerror}: {e.filename})") from None


def load_expert_stats(path: Optional[str], activity) -> Optional[dict]:
    """--expert-stats PATH: load the activity table when the file exists (the first run creates it)."""
    if not path or not Path(path).exists():
        return None
    try:
        data = activity.load(path)
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"--expert-stats {path}: not an expert stats file written by pagedmoe ({e!r})") from e
    logger.info("expert stats loaded from %s", path)
    return data


def save_expert_stats(path: str, activity, precision=None) -> None:
    """At exit: the activity table, and under dynamic precision the precision map and measured errors."""
    try:
        activity.save(path, precision.state_json() if precision is not None else None)
    except Exception as e:  # at interpreter exit: report, never raise
        logger.warning("could not save expert stats to %s: %s", path, e)


def start_dynamic_precision(config, model_path: str, store, kv, block_bytes: int, min_usable_blocks: int, activity,
                            stats: Optional[dict] = None):
    """Build the DynamicPrecisionManager of `--expert-precision dynamic` (the store's DynamicExperts was
    enabled before the KV cache was sized). A precision map in the stats file is the starting point
    when it fits the budget."""
    initial = rel = None
    if stats is not None:
        initial, rel = parse_state(stats, store.table.num_layers, store.table.num_experts)
    offline = OfflineForms.open(model_path, store.hidden, store.inter)
    if offline is not None:   # `pagedmoe compress --precisions`: forms and compress-time costs
        store.dynamic.offline = offline
        rel = rel if rel is not None else offline.rel_error()
        logger.info("dynamic expert precision: offline lossy forms %s", sorted(offline.files))
    if config.num_kv_blocks is not None:
        check_something_to_lend(kv.num_blocks, min_usable_blocks, block_bytes, store.dynamic.bytes_per_rung(),
                                store.dynamic.min_precision)
    low, high = config.experts.watermarks()
    mgr = DynamicPrecisionManager(store.dynamic, kv, block_bytes, low, high, store.dynamic.min_precision,
                                  activity=activity, min_usable_blocks=min_usable_blocks, initial=initial,
                                  rel_error=rel)
    logger.info("dynamic expert precision: %s; %d KV blocks lent to experts (watermarks %d / %d of %d blocks)",
                mgr.precision_counts(), mgr.withheld, mgr.watermarks.low, mgr.watermarks.high, mgr.num_blocks)
    return mgr


def check_something_to_lend(num_blocks: int, min_usable_blocks: int, block_bytes: int, bytes_per_rung: dict,
                            floor: str) -> None:
    """--num-kv-blocks: the blocks beyond one max_model_len sequence are all the experts can ever take above the
    floor. Where they cannot hold the smallest one-rung step of one expert, no expert could ever move: refused."""
    sizes = [bytes_per_rung[p] for p in LADDER[:rung_index(floor) + 1] if p in bytes_per_rung]
    step = min((a - b for a, b in zip(sizes, sizes[1:]) if a > b), default=None)
    if step is None or (num_blocks - min_usable_blocks) * block_bytes >= step:
        return
    need = min_usable_blocks + -(-step // block_bytes)
    raise ValueError(f"--expert-precision dynamic cannot take effect with --num-kv-blocks {num_blocks}: one "
                     f"max_model_len sequence keeps {min_usable_blocks} of them, and the rest cannot hold one expert "
                     f"a rung above --min-expert-precision {floor}, so every expert would stay at {floor}; give "
                     f"--num-kv-blocks {need} or more, or use --expert-precision static-{floor}")
