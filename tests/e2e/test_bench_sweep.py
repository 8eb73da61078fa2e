"""`pagedmoe bench sweep` on CPU with the default model: budgets around the model's size, so the resident
placement does not fit at the smaller one and does at the larger; JSON points, pager counters, PNGs."""
import json

import pytest

from pagedmoe.planning.kv_sizing import GiB

PNGS = ("throughput.png", "kv_capacity.png", "step_breakdown.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _weight_bytes() -> int:
    from pagedmoe.config import default_model_path
    from pagedmoe.planning.model_shape import ModelShape

    return ModelShape.from_hf_config(default_model_path(), dtype_bytes=4).weight_bytes  # float32 on CPU


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    from pagedmoe.cli import main

    out = tmp_path_factory.mktemp("sweep")
    # Below the weights resident cannot load; paging keeps the backbone and part of the experts on the "GPU".
    small = 0.8 * _weight_bytes() / GiB
    argv = ["bench", "sweep", "--budgets", f"{small:.4f}", "weights+0.03", "--placements", "resident", "paged",
            "--num-prompts", "4", "--input-len", "16", "--output-len", "8", "--max-model-len", "64",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--device", "cpu", "--output-dir", str(out)]
    assert main(argv) == 0
    return out, small, json.loads((out / "sweep.json").read_text())


def test_sweep_points(sweep):
    out, small, result = sweep
    points = result["points"]
    assert [(p["budget_arg"], p["placement"]) for p in points] == [
        (f"{small:.4f}", "resident"), (f"{small:.4f}", "paged"), ("weights+0.03", "resident"),
        ("weights+0.03", "paged")]
    assert points[2]["budget_bytes"] == _weight_bytes() + int(0.03 * GiB)
    no_fit = points[0]
    assert no_fit["status"] == "does_not_fit"
    assert small < no_fit["needs_gib"] <= points[2]["budget_gib"]
    for p in points[1:]:
        assert p["status"] == "ok", p
        assert p["num_output_tokens"] == 4 * 8 and p["kv_capacity_tokens"] > 0
        assert p["modelled"]["fits"] and p["modelled"]["output_throughput"] > 0
        b = p["breakdown"]
        assert b["prefill_s"] > 0 and b["decode_s"] > 0
    assert points[1]["expert_placement"] == "paged" and points[2]["expert_placement"] == "resident"
    assert points[2]["breakdown"]["pcie_h2d_bytes"] == 0 and points[2]["breakdown"]["pager_steps"] == 0
    # Paged: every host-tier expert is copied every step of the timed run, warm-up requests excluded
    # (4 prompts of 16 tokens: one prefill step, then 7 decode steps).
    paged = points[1]
    b = paged["breakdown"]
    assert b["pager_steps"] == paged["decode_steps"] + 1 == 8
    host_bytes = round(paged["memory_gib"]["host_tier"] * GiB)
    assert host_bytes > 0 and b["pcie_h2d_bytes"] == b["pager_steps"] * host_bytes
    cfg = result["config"]
    assert cfg["placement_flags"]["resident"]["expert_placement"] == "resident"
    assert cfg["num_prompts"] == 4 and result["complete"] and "git_commit" in result and "versions" in result


def test_sweep_pngs_and_replot(sweep, tmp_path):
    from pagedmoe.cli import main

    out, _, result = sweep
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC
    # Two "device calls" of one sweep merge into one result; the same point twice is kept once.
    merged = tmp_path / "merged"
    assert main(["bench", "sweep", "--replot", str(out / "sweep.json"), str(out / "sweep.json"),
                 "--output-dir", str(merged)]) == 0
    again = json.loads((merged / "sweep.json").read_text())
    assert len(again["points"]) == len(result["points"])
    for name in PNGS:
        assert (merged / name).read_bytes()[:8] == PNG_MAGIC


def test_remodel_recomputes_the_modelled_figures(sweep, tmp_path):
    """--remodel rebuilds each ok point's `modelled` from the placement and activations the engine planned:
    unchanged model, unchanged figures; a different hardware profile changes them."""
    from pagedmoe.cli import main

    out, _, result = sweep
    ok = {(p["budget_arg"], p["placement"]): p for p in result["points"] if p["status"] == "ok"}
    assert ok
    tampered = json.loads((out / "sweep.json").read_text())
    for p in tampered["points"]:
        if p["status"] == "ok":
            p["modelled"]["output_throughput"] = -1.0
    src = tmp_path / "tampered.json"
    src.write_text(json.dumps(tampered))
    assert main(["bench", "sweep", "--replot", str(src), "--remodel", "--no-plots", "--output-dir",
                 str(tmp_path / "a")]) == 0
    again = {(p["budget_arg"], p["placement"]): p for p in json.loads((tmp_path / "a" / "sweep.json").read_text())["points"]}
    for key, p in ok.items():
        assert again[key]["modelled"]["output_throughput"] == pytest.approx(p["modelled"]["output_throughput"])
        assert again[key]["fraction_of_modelled_throughput"] == pytest.approx(p["fraction_of_modelled_throughput"])
    slow = tmp_path / "slow.json"
    slow.write_text(json.dumps({"name": "slow", "hbm_bytes_per_s": 1e9, "gemm_flops": 1e9}))
    assert main(["bench", "sweep", "--replot", str(src), "--remodel", "--hardware-json", str(slow), "--no-plots",
                 "--output-dir", str(tmp_path / "b")]) == 0
    for p in json.loads((tmp_path / "b" / "sweep.json").read_text())["points"]:
        if p["status"] == "ok":
            assert 0 < p["modelled"]["output_throughput"] < ok[(p["budget_arg"], p["placement"])]["modelled"]["output_throughput"]


def test_placement_flags_apply_to_paged_only():
    import argparse

    from pagedmoe.bench.sweep import point_config, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sweep", "--budgets", "1", "--num-gpu-experts", "3", "--max-num-seqs", "7"])
    paged, resident, auto = (point_config(args, name, 2 * GiB) for name in ("paged", "resident", "auto"))
    assert (paged.expert_placement, paged.num_gpu_experts) == ("paged", 3)
    assert (resident.expert_placement, resident.num_gpu_experts) == ("resident", None)
    assert (auto.expert_placement, auto.num_gpu_experts) == ("auto", None)
    assert {c.gpu_memory_gb for c in (paged, resident, auto)} == {2.0}
    assert {c.max_num_seqs for c in (paged, resident, auto)} == {7}
    with pytest.raises(ValueError, match="cpu-moe"):  # --cpu-moe and --num-gpu-experts 3 contradict
        point_config(args, "cpu-moe", GiB)
    plain = parser.parse_args(["sweep", "--budgets", "1"])
    assert point_config(plain, "cpu-moe", GiB).placement() == ("paged", 0)
    lossless = point_config(args, "paged+lossless", GiB)
    assert (lossless.expert_compression, lossless.num_gpu_experts) == ("lossless", None)
    host = point_config(args, "paged+host-lossless", GiB)
    assert (host.host_compression, host.expert_placement, host.num_gpu_experts) == ("lossless", "paged", 3)
    assert point_config(args, "resident", GiB).host_compression is None   # the default (unset: raw host tier)
    dynamic = point_config(args, "dynamic", GiB)  # --num-gpu-experts would contradict it: reset
    assert (dynamic.expert_precision, dynamic.num_gpu_experts, dynamic.placement()) == ("dynamic", None, ("paged", 0))


def test_failed_points_are_recorded(tmp_path, monkeypatch):
    """An engine that cannot start (host memory, CUDA) costs its point, not the sweep's other points."""
    import pagedmoe.engine.llm_engine as llm_engine
    from pagedmoe.cli import main

    def refuse(config):
        if config.expert_placement == "paged":
            raise RuntimeError("CUDA error: out of memory (pinning the host tier)")
        raise ValueError("some other refusal without a budget")

    monkeypatch.setattr(llm_engine, "LLMEngine", refuse)
    assert main(["bench", "sweep", "--budgets", "1", "--placements", "resident", "paged", "--device", "cpu",
                 "--no-plots", "--output-dir", str(tmp_path)]) == 1  # nothing ran
    points = json.loads((tmp_path / "sweep.json").read_text())["points"]
    assert [(p["placement"], p["status"]) for p in points] == [("resident", "error"), ("paged", "error")]
    assert "out of memory" in points[1]["message"] and points[0]["needs_gib"] is None


def test_static_int4_point_is_measured_and_not_modelled(tmp_path):
    """static-int4 in the sweep: every expert int4 (no host tier), the sweep's paging flags reset, the point
    measured, the cost model (which has no quantized tier) not asked."""
    import argparse

    from pagedmoe.bench.sweep import point_config, register
    from pagedmoe.cli import main

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["sweep", "--budgets", "1", "--num-gpu-experts", "3"])
    static = point_config(args, "static-int4", GiB)
    assert (static.expert_precision, static.num_gpu_experts, static.placement()) == ("static-int4", None, ("paged", 0))
    out = tmp_path / "s"
    argv = ["bench", "sweep", "--budgets", "weights+0.03", "--placements", "static-int4", "--num-prompts", "2",
            "--input-len", "8", "--output-len", "4", "--max-model-len", "32", "--max-num-seqs", "2",
            "--max-num-batched-tokens", "32", "--device", "cpu", "--no-plots", "--output-dir", str(out)]
    assert main(argv) == 0
    point = json.loads((out / "sweep.json").read_text())["points"][0]
    assert point["status"] == "ok" and point["experts"] == {"quantized/int4": sum(point["experts"].values())}
    assert not point["modelled"]["fits"] and "not modelled" in point["modelled"]["error"]
    assert "device_memory" not in point     # CPU: no device to count
