"""benchmarks/vs_vllm.sh and vs_vllm_table.py: vLLM's and pagedmoe's printed lines parse into the table
(fixtures in tests/unit/data/vs_vllm/, in the format vLLM's bench commands print), and a dry run of the
script on CPU with a stand-in vllm package and the tiny default model writes that table end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vs_vllm_table as vt  # noqa: E402

DATA = Path(__file__).parent / "data" / "vs_vllm"


def test_parse_vllm_lines():
    assert vt.parse_throughput((DATA / "qwen3-30b-a3b.tput.vllm.log").read_text()) == {
        "requests_per_s": 7.43, "total_tokens_per_s": 15220.48, "output_tokens_per_s": 7610.24}
    # the progress bar's "output: 7610.24 toks/s" is not the figure; percentiles are not the average
    assert vt.parse_vllm_latency((DATA / "qwen3-30b-a3b.lat.vllm.log").read_text()) == {"latency_s": 0.29750112}
    assert vt.parse_throughput("no figure here") is None
    assert vt.parse_vllm_latency("50% percentile latency: 0.3 seconds") is None
    # the last line wins (a log that holds a retried run)
    two = "Throughput: 1.00 requests/s, 2.00 total tokens/s, 3.00 output tokens/s\n" \
          "Throughput: 4.00 requests/s, 5.00 total tokens/s, 6.00 output tokens/s\n"
    assert vt.parse_throughput(two)["output_tokens_per_s"] == 6.0


def test_parse_pagedmoe_latency_json_then_text():
    on = vt.parse_run(DATA / "qwen3-30b-a3b.lat.pagedmoe-fused-on.log")
    assert on["latency_s"] == pytest.approx(0.04 + 0.032)  # the JSON: prefill + every decode step
    off = vt.parse_run(DATA / "qwen3-30b-a3b.lat.pagedmoe-fused-off.log")  # no JSON: prefill + 63 x median
    assert off["latency_s"] == pytest.approx((41.20 + 63 * 9.570) / 1e3)
    assert off["median_decode_step_ms"] == 9.57


def test_parse_pagedmoe_request_latency_over_the_step_sum():
    # runs since the wall-time request latency: it wins over the steps' sum (which --async-scheduling splits
    # only roughly), in the JSON and in the printed lines
    text = ("Batch 1: request latency 301.50 ms (512 in, 64 out; first step to last, wall)\n"
            "Batch 1: prefill 55.69 ms for 1 x 512 tokens (9194 tokens/s)\n"
            "Batch 1: decode step (median of 63) 4.407 ms; HBM floor 1.461 ms; floor/measured = 0.33\n")
    assert vt.parse_pagedmoe_latency(text, None)["latency_s"] == pytest.approx(0.3015)
    record = {"results": [{"batch_size": 1, "request_latency_s": 0.3, "prefill_time_s": 0.05,
                           "decode_step_ms": [4.0] * 63, "median_decode_step_ms": 4.0}]}
    got = vt.parse_pagedmoe_latency(text, record)
    assert got["latency_s"] == 0.3 and got["decode_steps"] == 63


def test_table_rows_and_ratios(tmp_path):
    result = vt.collect([DATA])
    rows = {(r["model"], r["regime"]): r for r in vt.rows(result)}
    tput = rows[("qwen3-30b-a3b", "tput")]
    assert tput["vllm"] == 7610.24
    assert tput["pagedmoe"]["pagedmoe"]["ratio_over_vllm"] == pytest.approx(4951.80 / 7610.24)
    lat = rows[("qwen3-30b-a3b", "lat")]
    assert lat["pagedmoe"]["pagedmoe-fused-on"]["ratio_over_vllm"] == pytest.approx(0.29750112 / 0.072)  # vLLM / ours
    w4 = rows[("qwen3-30b-a3b", "w4")]
    assert w4["pagedmoe"]["pagedmoe-paged-lossless"]["error"].startswith("torch.OutOfMemoryError")
    assert w4["pagedmoe"]["pagedmoe-resident"]["value"] == 623.5
    assert [r["regime"] for r in vt.rows(result)] == ["tput", "w4", "lat"]
    md = vt.markdown(vt.rows(result))
    assert "60.87 GiB, utilization 0.4335" in md and "resident: 0.65x" in md and "paged-lossless: failed" in md
    assert vt.main([str(DATA), "--out", str(tmp_path / "t")]) == 0
    saved = json.loads((tmp_path / "t.json").read_text())
    assert len(saved["rows"]) == 3 and (tmp_path / "t.md").read_text() == md
    assert vt.main([str(tmp_path / "missing")]) == 2


STUB = '''import os, sys
with open(os.environ["STUB_ARGS_LOG"], "a") as f:
    f.write(" ".join(sys.argv[1:]) + "\\n")
print("INFO 12-01 10:00:00 [llm.py:1] stand-in vLLM")
if sys.argv[1:3] == ["bench", "throughput"]:
    print("Throughput: 2.00 requests/s, 4096.00 total tokens/s, 2048.00 output tokens/s")
elif sys.argv[1:3] == ["bench", "latency"]:
    print("Avg latency: 0.2500 seconds")
'''


def test_list_and_calls():
    out = subprocess.run(["bash", str(ROOT / "benchmarks" / "vs_vllm.sh"), "list"], capture_output=True, text=True,
                         check=True).stdout
    parts = [line.split()[0] for line in out.splitlines() if line.startswith(("tput-", "w4-", "w4p-", "pf-", "lat-"))]
    assert sorted(parts) == sorted(f"{r}-{m}" for r in ("tput", "w4", "w4p", "pf", "lat") for m in ("qwen3", "mixtral"))
    calls = subprocess.run(["bash", str(ROOT / "benchmarks" / "vs_vllm.sh"), "calls"], capture_output=True,
                           text=True, check=True, cwd=ROOT).stdout
    planned = [line.split("vs_vllm.sh ")[1].split('"')[0].split() for line in calls.splitlines()
               if "bash benchmarks/vs_vllm.sh " in line and line.startswith("run(")]
    assert sorted(p for call in planned for p in call) == sorted(parts)  # every part in exactly one call


def _stub_site(tmp_path) -> Path:
    site = tmp_path / "site" / "vllm" / "entrypoints" / "cli"
    site.mkdir(parents=True)
    (tmp_path / "site" / "vllm" / "__init__.py").write_text('__version__ = "stub"\n')
    (site.parent / "__init__.py").write_text("")
    (site / "__init__.py").write_text("")
    (site / "main.py").write_text(STUB)
    return tmp_path / "site"


def test_dry_run_on_cpu(tmp_path):
    """The script end to end: stand-in vLLM, the tiny default model on CPU, tiny workloads."""
    args_log = tmp_path / "vllm_args.txt"
    env = dict(os.environ, OUT=str(tmp_path / "out"), VLLM_SITE=str(_stub_site(tmp_path)), STUB_ARGS_LOG=str(args_log),
               QWEN3_MODEL="src/pagedmoe/default_model", DEVICE_GIB="8", PM_EXTRA="--device cpu --dtype float32",
               MAX_LEN="64", TPUT_PROMPTS="2", TPUT_LEN="4", LAT_IN="6", LAT_OUT="3", PROF_BATCHES="1",
               PROF_LEN="4", PROF_STEPS="1", PM_FUSED="on", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/vs_vllm.sh", "tput-qwen3", "lat-qwen3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = tmp_path / "out" / "vs_vllm"
    table = json.loads((d / "table.json").read_text())
    rows = {r["regime"]: r for r in table["rows"]}
    assert rows["tput"]["vllm"] == 2048.0 and rows["lat"]["vllm"] == 0.25
    ours_tput = rows["tput"]["pagedmoe"]["pagedmoe"]
    assert ours_tput["error"] is None and ours_tput["value"] > 0
    ours_lat = rows["lat"]["pagedmoe"]["pagedmoe-fused-on"]
    assert ours_lat["error"] is None and ours_lat["value"] > 0
    assert json.loads((d / "qwen3-30b-a3b.lat.pagedmoe-fused-on.json").read_text())["config"]["fused_ops"] == "on"
    assert (d / "qwen3-30b-a3b.prof-fused-on" / "profile_b1.json").exists()
    calls = args_log.read_text().splitlines()
    assert calls[0].startswith("bench throughput") and "--gpu-memory-utilization 0.97" in calls[0]
    assert "--num-prompts 2" in calls[0] and "--max-num-batched-tokens 8192" in calls[0]
    assert calls[1].startswith("bench latency") and "--batch-size 1 --input-len 6 --output-len 3" in calls[1]
    meta = json.loads((d / "qwen3-30b-a3b.meta.json").read_text())
    assert meta["device_gib"] == 8.0 and meta["w4_utilization"] == pytest.approx(meta["w4_budget_gib"] / 8, abs=1e-4)


@pytest.mark.parametrize("switches, vllm_runs, variants", [
    ({"W4_VARIANTS": ""}, 1, []),                             # vLLM alone
    ({"W4_VLLM": "0", "W4_VARIANTS": "bogus"}, 0, []),   # no vLLM run; the unknown variant refused before it runs
])
def test_w4_switches_pick_the_runs(tmp_path, switches, vllm_runs, variants):
    """W4_VARIANTS="" runs vLLM alone in part w4, W4_VLLM=0 the pagedmoe variants alone (a long Mixtral part split
    over two device calls; the pagedmoe runs themselves are test_dry_run_on_cpu's)."""
    args_log = tmp_path / "vllm_args.txt"
    env = dict(os.environ, OUT=str(tmp_path / "out"), VLLM_SITE=str(_stub_site(tmp_path)), STUB_ARGS_LOG=str(args_log),
               QWEN3_MODEL="src/pagedmoe/default_model", DEVICE_GIB="8", PM_EXTRA="--device cpu --dtype float32",
               MAX_LEN="64", TPUT_LEN="4", W4_PROMPTS="2", OMP_NUM_THREADS="1", **switches)
    proc = subprocess.run(["bash", "benchmarks/vs_vllm.sh", "w4-qwen3"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert (proc.returncode == 0) == (switches["W4_VARIANTS"] != "bogus"), proc.stdout + proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("--- ")]
    assert len([r for r in runs if " vllm " in r]) == vllm_runs, proc.stdout
    assert [r.split(" pagedmoe ")[1].split()[0] for r in runs if " pagedmoe " in r] == variants, proc.stdout
    assert (len(args_log.read_text().splitlines()) if args_log.exists() else 0) == vllm_runs


def test_pack_out_keeps_everything_in_one_archive(tmp_path):
    """benchmarks/pack_out.sh (vs_vllm.sh with PACK=1): the folder becomes one .tgz holding every file, its summary
    files are copied beside it, and the folder is gone (a device call returns only a few files)."""
    import tarfile

    d = tmp_path / "vs_vllm"
    (d / "prof").mkdir(parents=True)
    for name, text in (("table.md", "| t |"), ("a.log", "x"), ("prof/profile_b1.json", "{}")):
        (d / name).write_text(text)
    subprocess.run(["bash", str(ROOT / "benchmarks" / "pack_out.sh"), str(d), "table.md", "missing.txt"],
                   check=True, capture_output=True, text=True)
    assert not d.exists()
    assert (tmp_path / "vs_vllm_table.md").read_text() == "| t |"
    assert not (tmp_path / "vs_vllm_missing.txt").exists()
    with tarfile.open(tmp_path / "vs_vllm.tgz") as tar:
        assert {m.name for m in tar.getmembers() if m.isfile()} == {
            "vs_vllm/table.md", "vs_vllm/a.log", "vs_vllm/prof/profile_b1.json"}


def test_prefill_part_compares_total_tokens(tmp_path):
    """Part pf: both engines at the whole GPU on prompts with one output token each; the table sets pagedmoe's
    prompt + output tokens/s against vLLM's (the stand-in prints 4096 total, 2048 output)."""
    args_log = tmp_path / "vllm_args.txt"
    env = dict(os.environ, OUT=str(tmp_path / "out"), VLLM_SITE=str(_stub_site(tmp_path)), STUB_ARGS_LOG=str(args_log),
               QWEN3_MODEL="src/pagedmoe/default_model", DEVICE_GIB="8", PM_EXTRA="--device cpu --dtype float32",
               MAX_LEN="64", TPUT_LEN="8", PF_PROMPTS="3", OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "benchmarks/vs_vllm.sh", "pf-qwen3"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    call = args_log.read_text().splitlines()[0]
    assert "--random-output-len 1 --num-prompts 3 --gpu-memory-utilization 0.97" in call
    table = json.loads((tmp_path / "out" / "vs_vllm" / "table.json").read_text())
    (row,) = table["rows"]
    ours = row["pagedmoe"]["pagedmoe"]
    assert row["regime"] == "pf" and row["vllm"] == 4096.0 and ours["error"] is None
    run = next(r for r in table["runs"] if r["engine"] == "pagedmoe")
    assert ours["value"] == run["total_tokens_per_s"] > run["output_tokens_per_s"]
    assert ours["ratio_over_vllm"] == pytest.approx(ours["value"] / 4096.0)
