"""PNG plots of a `bench sweep` result (matplotlib, Agg backend: no display needed).

- throughput.png: measured output tokens/s against the GPU budget, one line per placement (solid), the
  planner's modelled figure for the same placement as a dashed line of the same colour; one panel per model.
- kv_capacity.png: KV cache capacity in tokens against the budget, per placement.
- step_breakdown.png: per point, the timed run's wall time split into prefill and decode steps, next to the
  expert copy stream's busy time split into what the compute stream waited for and what it hid; below,
  the measured mean decode step against the modelled decode-step floors (PCIe, decode, HBM, compute).
Points that did not fit are left out of the lines and named in the breakdown's labels.
"""
from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _models(points: list[dict]) -> list[str]:
    return sorted({str(p.get("model")) for p in points})


def _by_placement(points: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for p in sorted(points, key=lambda p: p["budget_gib"]):
        out.setdefault(p["placement"], []).append(p)
    return out


def _line_figure(plt, points: list[dict], ylabel: str, measured, model=None, title: str = ""):
    models = _models(points)
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    for ax, name in zip(axes[0], models):
        mine = [p for p in points if str(p.get("model")) == name]
        for i, (placement, pts) in enumerate(_by_placement(mine).items()):
            color = f"C{i}"
            ok = [p for p in pts if p["status"] == "ok"]
            ax.plot([p["budget_gib"] for p in ok], [measured(p) for p in ok], "o-", color=color, label=placement)
            if model is not None:
                mod = [p for p in ok if (p.get("modelled") or {}).get("fits")]
                if mod:
                    ax.plot([p["budget_gib"] for p in mod], [model(p) for p in mod], "x--", color=color, alpha=0.6,
                            label=f"{placement} (modelled)")
            for p in pts:  # placements that could not run at this budget: a mark on the x axis
                if p["status"] != "ok":
                    ax.plot([p["budget_gib"]], [0], "v", color=color, alpha=0.6,
                            transform=ax.get_xaxis_transform(), clip_on=False)
        values = [measured(p) for p in mine if p["status"] == "ok"]
        if values and min(values) > 0 and max(values) / min(values) > 20:
            ax.set_yscale("log")  # paged points streaming every expert sit 100x below resident ones
        ax.set_xlabel("GPU memory budget (GiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{name}: {title}" if title else name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _label(p: dict) -> str:
    return f"{p['placement']}\n{p['budget_gib']:.3g} GiB" + (f"\n{p['model']}" if p.get("model") else "")


def _breakdown_figure(plt, points: list[dict]):
    import numpy as np

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(points) + 2), 8.5))
    x = np.arange(len(points))
    ok = [p["status"] == "ok" for p in points]
    b = [p.get("breakdown", {}) for p in points]
    prefill = [d.get("prefill_s", 0.0) for d in b]
    decode = [d.get("decode_s", 0.0) for d in b]
    wait = [d.get("expert_wait_s", 0.0) for d in b]
    hidden = [max(0.0, d.get("expert_copy_s", 0.0) - d.get("expert_wait_s", 0.0)) for d in b]
    w = 0.38
    top.bar(x - w / 2, prefill, w, label="prefill steps (wall)", color="C0")
    top.bar(x - w / 2, decode, w, bottom=prefill, label="decode steps (wall)", color="C1")
    top.bar(x + w / 2, wait, w, label="compute waited for experts", color="C3")
    top.bar(x + w / 2, hidden, w, bottom=wait, label="expert copies hidden behind compute", color="C2", alpha=0.6)
    for i, p in enumerate(points):
        if ok[i]:
            gb = p["breakdown"].get("pcie_h2d_bytes", 0) / 1e9
            top.annotate(f"{gb:.3g} GB H2D", (x[i], prefill[i] + decode[i]), ha="center", va="bottom", fontsize=7)
        else:
            top.annotate("does not fit" if p["status"] == "does_not_fit" else p["status"], (x[i], 0), ha="center",
                         va="bottom", fontsize=7, rotation=90)
    top.set_ylabel("seconds (timed run)")
    top.set_title("Step-time breakdown: left bar wall time, right bar the expert copy stream")
    top.legend(fontsize=8)
    # Decode step: measured mean vs the planner's floors (one step of the modelled batch).
    keys = ("pcie", "decode", "hbm", "compute")
    w = 0.8 / (len(keys) + 1)
    measured = [p.get("mean_decode_step_ms", 0.0) if ok[i] else 0.0 for i, p in enumerate(points)]
    bottom.bar(x - 0.4 + w / 2, measured, w, label="measured mean decode step", color="k")
    for k, key in enumerate(keys):
        vals = [((p.get("modelled") or {}).get("decode_step_ms") or {}).get(key, 0.0) for p in points]
        bottom.bar(x - 0.4 + w * (k + 1.5), vals, w, label=f"modelled {key} floor", color=f"C{k + 4}")
    bottom.set_ylabel("ms per decode step")
    bottom.set_yscale("symlog", linthresh=1e-3)
    bottom.set_title("Decode step: measured against the modelled floors")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.set_xticks(x)
        ax.set_xticklabels([_label(p) for p in points], fontsize=7)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def plot_sweep(result: dict, out_dir: Path) -> list[Path]:
    """Write the three PNGs of a sweep result into out_dir; returns their paths."""
    plt = _pyplot()
    points = result["points"]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures = {
        "throughput.png": _line_figure(plt, points, "output tokens/s", lambda p: p["output_tokens_per_second"],
                                       lambda p: p["modelled"]["output_throughput"], "throughput vs budget"),
        "kv_capacity.png": _line_figure(plt, points, "KV cache capacity (tokens)", lambda p: p["kv_capacity_tokens"],
                                        title="KV capacity vs budget"),
        "step_breakdown.png": _breakdown_figure(plt, points),
    }
    paths = []
    for name, fig in figures.items():
        path = out_dir / name
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
