"""The planner's figures for a sweep point (`pagedmoe bench sweep`, bench/sweep.py): for the placement an
engine took (`modelled`), for a stored point under the current cost model (`remodel`, `--remodel`), and
the minimum budget an engine's refusal names. Pure Python (the cost model, planning/).
"""
from __future__ import annotations

import re
from typing import Optional

from pagedmoe.experts.table import COMPRESSED, HOST, RESIDENT
from pagedmoe.planning.kv_sizing import GiB
from pagedmoe.planning.model_shape import ModelShape
from pagedmoe.planning.placement import Placement
from pagedmoe.planning.planner import PlacementBudgetError, PlanInputs, plan_placement


def needs_gib(err: Exception) -> Optional[float]:
    """The minimum budget an engine refusal names (PlacementBudgetError carries it; BudgetError says it)."""
    if getattr(err, "min_budget_bytes", None) is not None:
        return err.min_budget_bytes / GiB
    m = re.search(r"(?:minimum is|needs) ([0-9.]+) GiB", str(err))
    return float(m.group(1).rstrip(".")) if m else None


def modelled(engine, shape, budget_bytes: int, num_prompts: int, input_len: int, output_len: int, hw) -> dict:
    """The planner's figures for the placement this engine holds, on this workload (pure Python model)."""
    store, c = engine.expert_store, engine.config
    if store.dynamic is not None:
        return {"fits": False, "placement": "dynamic",
                "error": "not modelled: under dynamic precision the experts' rungs change while it runs"}
    if store.quantized_bytes:
        return {"fits": False, "placement": c.expert_precision,
                "error": "not modelled: the cost model has no quantized tier"}
    table = store.table
    L, E = table.num_layers, table.num_experts
    if not store.paged:
        placement, buffers = Placement.resident(L, E), "vmm"
    else:
        gpu = tuple(table.count(layer, RESIDENT) for layer in range(L))
        comp = tuple(table.count(layer, COMPRESSED) for layer in range(L))
        ratio = store.compressed_bytes / (sum(comp) * shape.expert_bytes) if sum(comp) else 0.0
        placement = Placement(E, gpu, comp, ratio)
        buffers = engine.expert_plan.buffers   # settled at start-up (engine/startup.py)
    n_host = sum(table.count(layer, HOST) for layer in range(L)) if store.paged else 0
    host_ratio = (store.host_bytes / (n_host * shape.expert_bytes)
                  if store.paged and store.host_compression == "lossless" and n_host else 0.0)
    # the model sizes KV from what the engine kept out of it: activations and the start-up reserve
    return model_placement(shape, placement, buffers, budget_bytes,
                           engine.plan.activation_bytes + engine.plan.reserve_bytes, engine.max_model_len,
                           c.block_size, c.max_num_seqs, c.max_num_batched_tokens, num_prompts, input_len,
                           output_len, hw, host_ratio)


def model_placement(shape, placement, buffers: str, budget_bytes: int, activation_bytes: int, max_model_len: int,
                    block_size: int, max_num_seqs: int, max_num_batched_tokens: int, num_prompts: int,
                    input_len: int, output_len: int, hw, host_compression_ratio: float = 0.0) -> dict:
    """The planner's figures for one placement on one workload: what `modelled` reports for an engine, and
    `--remodel` recomputes from a stored point. host_compression_ratio: the host tier's bytes over bf16
    (--host-compression lossless; 0: raw), which sets its PCIe traffic and adds its decode."""
    # The engine gives the KV cache at most what max_num_seqs full-length sequences can use: so does the model.
    useful_blocks = max_num_seqs * -(-max_model_len // block_size)
    try:
        inputs = PlanInputs(shape, budget_bytes, activation_bytes, max_model_len, block_size,
                            (input_len, output_len), min(max_num_seqs, num_prompts), max_num_batched_tokens,
                            hw, max_kv_blocks=useful_blocks, buffers=buffers,
                            host_compression_ratio=host_compression_ratio)
        plan = plan_placement(inputs, placement)
    except PlacementBudgetError as e:
        return {"fits": False, "placement": placement.label(), "min_budget_gib": needs_gib(e), "error": str(e)}
    except ValueError as e:
        return {"fits": False, "placement": placement.label(), "error": str(e)}
    d = plan.estimate.decode
    return {"fits": True, "placement": placement.label(), "hardware": hw.name,
            "output_throughput": plan.estimate.output_throughput,
            "total_token_throughput": plan.estimate.total_throughput, "num_seqs": plan.num_seqs,
            "kv_capacity_tokens": plan.kv_capacity_tokens,
            "decode_step_ms": {"pcie": d.pcie_s * 1e3, "decode": d.decode_s * 1e3, "hbm": d.hbm_s * 1e3,
                               "compute": d.compute_s * 1e3, "floor": d.floor_s * 1e3, "total": d.total_s * 1e3,
                               "bound": d.bound},
            "prefill_s_per_seq": plan.estimate.prefill_s_per_seq, "plan": plan.to_dict()}


def remodel(point: dict, config: dict, hw) -> dict:
    """A stored point with its `modelled` figures recomputed by the current cost model (and `hw`)."""
    if point.get("status") != "ok":
        return point
    shape = ModelShape(**config["shape"])
    ep, eng = point.get("engine_plan"), config["engine"]
    if point["expert_placement"] == "resident":
        placement, buffers = Placement.resident(shape.num_moe_layers, shape.experts_per_gpu), "vmm"
    elif ep:
        pl = ep["placement"]
        placement = Placement(pl["num_experts"], tuple(pl["num_gpu_experts"]), tuple(pl["num_compressed_experts"]),
                              pl["compression_ratio"])
        buffers = ep["buffers"] if ep["buffers"] in ("vmm", "vmm-ring", "plain") else "vmm"
    else:  # paged by flags: no planner split was stored
        return point
    activation_bytes = int(round((point["memory_gib"]["activations"] + point["memory_gib"].get("reserve", 0)) * GiB))
    n_host = sum(n for tier, n in point.get("experts", {}).items() if tier.startswith("host/"))
    host_ratio = (point["memory_gib"]["host_tier"] * GiB / (n_host * shape.expert_bytes)
                  if point.get("engine_flags", {}).get("host_compression") == "lossless" and n_host else 0.0)
    m = model_placement(shape, placement, buffers, point["budget_bytes"], activation_bytes,
                        eng["max_model_len"], eng["block_size"], eng["max_num_seqs"], eng["max_num_batched_tokens"],
                        point["num_requests"], config["input_len"], config["output_len"], hw, host_ratio)
    out = {**point, "modelled": m}
    if m.get("fits"):
        out["fraction_of_modelled_throughput"] = point["output_tokens_per_second"] / m["output_throughput"]
        out["decode_step_over_floor"] = point["mean_decode_step_ms"] / m["decode_step_ms"]["floor"]
    return out
