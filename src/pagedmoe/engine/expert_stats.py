"""The expert subsystem's figures in the engine's stats (`LLMEngine.get_stats`) and the one-line summary of
the pager's traffic that `LLM.generate` logs and `bench throughput` prints."""
from __future__ import annotations

from typing import Optional


def dtype_label(dtype) -> str:
    """The precision label of weights held in `dtype`: bf16, fp16, fp32."""
    name = str(dtype).replace("torch.", "")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name)


def expert_stats(store, pager, precision) -> dict:
    """Placement, experts per (tier, precision), bytes per tier; the pager's counters; dynamic precision's.
    The table calls the exact rung "bf16" whatever the weights' dtype: the label says the dtype they are held in."""
    exact = dtype_label(store.dtype)
    out = {"expert_placement": "paged" if store.paged else "resident",
           "experts": {f"{tier}/{exact if prec == 'bf16' else prec}": n
                       for (tier, prec), n in store.table.counts().items()},
           "expert_resident_bytes": store.resident_bytes, "expert_compressed_bytes": store.compressed_bytes,
           "expert_quantized_bytes": store.quantized_bytes, "expert_host_bytes": store.host_bytes,
           "expert_buffer_bytes": store.buffer_bytes}
    if pager is not None:
        out.update({f"expert_{k}": v for k, v in pager.stats.as_dict().items()})
        if hasattr(pager, "cache_stats"):   # --expert-fetch routed: the expert cache's hits, misses, bytes
            out.update({f"expert_cache_{k}": v for k, v in pager.cache_stats().items()})
    if precision is not None:
        out.update(precision.as_dict())
    return out


def traffic_summary(now: dict, since: Optional[dict], cuda: bool) -> str:
    """One line on the pager's work between the expert_stats snapshots `since` and `now`: bytes host->device in
    all and per step, copy time, time compute waited for experts, the share of copying hidden behind compute.
    Copy and wait times come from CUDA events of eager steps (graph replays are counted in bytes only)."""
    keys = ("expert_bytes_h2d", "expert_bytes_decoded", "expert_copy_s", "expert_wait_s", "expert_steps",
            "expert_timed_steps", "expert_timed_bytes_h2d")
    d = {k: now.get(k, 0) - (since or {}).get(k, 0) for k in keys}
    steps = max(1, d["expert_steps"])
    text = (f"expert paging: {d['expert_bytes_h2d'] / 1e9:.2f} GB host->device over {d['expert_steps']} steps "
            f"({d['expert_bytes_h2d'] / steps / 1e9:.3f} GB/step)")
    if d["expert_bytes_decoded"]:
        text += f", {d['expert_bytes_decoded'] / 1e9:.2f} GB decoded"
    if d["expert_copy_s"] > 0:
        # the events time eager steps only: the rate and the hidden share are those steps' (a replayed decode
        # step's copies are counted in bytes above, not in copy_s)
        hidden = 1.0 - d["expert_wait_s"] / d["expert_copy_s"]
        rate = f"{d['expert_timed_bytes_h2d'] / d['expert_copy_s'] / 1e9:.1f} GB/s, " if d["expert_timed_bytes_h2d"] \
            else ""
        timed = (f" in the {d['expert_timed_steps']} eager steps timed" if d["expert_timed_steps"] < d["expert_steps"]
                 else "")
        text += (f"; copy stream busy {d['expert_copy_s']:.2f} s{timed} ({rate}compute waited "
                 f"{d['expert_wait_s']:.2f} s, {100 * max(0.0, hidden):.0f}% of copying hidden)")
    elif cuda:
        text += "; copy time not timed (CUDA-graph replays)"
    return text
