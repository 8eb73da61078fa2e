"""`pagedmoe plan`'s routed fetching section (planning/routed_plan.py): the placements chosen for routed fetching
next to the stream-all search's pick, with the modelled decode step of each at batch 1, 8, 32 and at max_num_seqs,
and the one --expert-fetch auto (or routed) takes."""
from __future__ import annotations


def routed_rows(args, inputs, rows, context_len: float):
    """Routed fetching's placements next to the stream-all search's pick (planning/routed_plan.py): the picks
    (stream-optimised first), the one auto takes, and rows for the table; None when the search does not apply
    (--expert-fetch stream, a placement fixed or resident, no auto plan)."""
    import dataclasses

    from pagedmoe.planning import routed_plan
    from pagedmoe.planning.placement import LOSSLESS_PLANNING_RATIO

    auto = next((r for r in rows if r[2] and not isinstance(r[1], Exception)), None)
    if args.expert_fetch == "stream" or args.num_gpu_experts is not None or args.cpu_moe or auto is None or \
            args.expert_placement == "resident" or args.compressed_gemm != "decode":
        return None
    bf16 = args.dtype in ("auto", "bfloat16")
    ratio = routed_plan.routed_compression_ratio(args.expert_compression, bf16)
    ratio = args.compression_ratio or ratio if ratio else None
    host_mode = "lossless" if inputs.host_compression_ratio else "none"
    stream = routed_plan.settle(auto[1], inputs, host_mode, args.expert_fetch, context_len, "stream-optimised")
    routed = [routed_plan.best_routed(dataclasses.replace(
        inputs, host_compression_ratio=LOSSLESS_PLANNING_RATIO if mode == "lossless" else 0.0), ratio, context_len,
        args.expert_fetch)
        for mode in routed_plan.routed_host_modes(args.host_compression, bf16)]
    routed = [p for p in routed if p is not None]
    if stream.fetch == "resident":
        return None
    return [stream, *routed], routed_plan.choose(stream, routed, args.expert_fetch)


def format_routed(picks, chosen, max_num_seqs: int, context_len: float) -> str:
    from pagedmoe.planning.fetch_cost import PLAN_BATCHES

    lines = [f"placements for routed fetching (planning/routed_plan.py; auto picks by the modelled decode step at "
             f"max_num_seqs={max_num_seqs}, or the sequences the KV cache holds): decode step ms by its fetch"]
    head = f"  {'placement':<44}{'fetch':>8}" + "".join(f"{f'b={b}':>9}" for b in PLAN_BATCHES) + \
        f"{'seqs':>6}{'step':>9}{'tok/s':>8}"
    lines += [head, "  " + "-" * (len(head) - 2)]
    for p in picks:
        ms = p.steps_ms(PLAN_BATCHES, context_len)
        mark = "*" if p is chosen else " "
        label = f"{p.origin}: {p.label()}"
        lines.append(f"{mark} {label:<44}{p.fetch:>8}" + "".join(f"{ms[b]:>9.1f}" for b in PLAN_BATCHES)
                     + f"{p.num_seqs:>6}{p.step_s * 1e3:>9.1f}{p.decode_tokens_per_s:>8.1f}")
    if len(picks) == 1:
        lines.append(f"  (no placement searched for routed fetching settles on it at max_num_seqs={max_num_seqs}: "
                     "stream-all is modelled within ROUTED_MARGIN or faster there)")
    lines.append(f"auto picks the {chosen.origin} placement {chosen.label()} (--expert-fetch {chosen.fetch}): "
                 f"{chosen.step_s * 1e3:.1f} ms per decode step at {chosen.num_seqs} sequences")
    return "\n".join(lines)
