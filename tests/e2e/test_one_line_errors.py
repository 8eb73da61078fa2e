"""One line, no traceback: a bad PAGEDMOE_* value (even for --help), Ctrl-C in chat and generate (exit 130),
a checkpoint tensor of the wrong shape (file and tensor named); NaN/inf in loaded weights is a warning naming
the tensor, and the model still loads."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pagedmoe
from pagedmoe.cli import main
from tiny_models import make_tiny_checkpoint

SRC = str(Path(pagedmoe.__file__).resolve().parents[1])


def _one_line(text: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text, text
    return text


@pytest.mark.parametrize("var, value, expected", [
    ("PAGEDMOE_MAX_MODEL_LEN", "abc", "an integer"),
    ("PAGEDMOE_GPU_MEMORY_GB", "24GB", "a number"),
    ("PAGEDMOE_ENFORCE_EAGER", "maybe", "a boolean"),
    ("PAGEDMOE_DTYPE", "fp12", "one of auto, bfloat16, float16, float32"),
    ("PAGEDMOE_PORT", "http", "an integer"),                       # a server flag
    ("PAGEDMOE_DISABLE_UVICORN_ACCESS_LOG", "maybe", "a boolean"),  # a server switch (was read as off)
    ("PAGEDMOE_REQUEST_TIMEOUT", "soon", "a number of seconds"),
])
@pytest.mark.parametrize("cmd", [["--help"], ["generate", "--help"], ["plan", "--help"], ["serve"]], ids=" ".join)
def test_bad_env_value_is_one_line(monkeypatch, capsys, var, value, expected, cmd):
    monkeypatch.setenv(var, value)
    assert main(cmd) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("pagedmoe: error: ") and f"{var}={value!r}" in err and f"expected {expected}" in err


def test_empty_env_value_means_unset(monkeypatch):
    from pagedmoe.config import env_default

    monkeypatch.setenv("PAGEDMOE_MAX_MODEL_LEN", "")
    assert env_default("max_model_len", int, 7) == 7
    monkeypatch.setenv("PAGEDMOE_MAX_MODEL_LEN", "64")
    assert env_default("max_model_len", int, 7) == 64


@pytest.mark.parametrize("name, content, expected", [
    ("prompts.txt", b"def f(\xff\xfe\n", "prompts.txt is not UTF-8 text (byte 6"),
    ("prompts.jsonl", b'{"prompt": "ok"}\n{"prompt": 5}\n', 'prompts.jsonl:2: "prompt" must be a string, got int'),
    ("prompts.jsonl", b'{"prompt": "ok"}\n\n[1]\n',
     'prompts.jsonl:3: expected {"prompt": ...} (list indices must be integers or slices, not str)'),
    ("folder", None, "folder is not a file"),
])
def test_bad_prompts_file_is_one_line_naming_it(tmp_path, capsys, name, content, expected):
    path = tmp_path / name
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    assert main(["generate", "--prompts-file", str(path), "--device", "cpu"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("pagedmoe generate: error: ") and expected in err, err


@pytest.mark.parametrize("flag, value", [("--gpu-memory-gb", "inf"), ("--gpu-memory-gb", "nan"),
                                         ("--swap-space", "inf"), ("--swap-space", "nan")])
def test_non_finite_sizes_are_one_line(capsys, flag, value):
    assert main(["generate", "--prompt", "x", "--device", "cpu", flag, value]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith(f"pagedmoe generate: error: {flag[2:].replace('-', '_')} must be"), err


def test_prompt_that_is_not_utf8_is_one_line(capsys):
    # a non-UTF-8 byte in argv reaches Python as a lone surrogate, which the tokenizer cannot encode
    assert main(["generate", "--prompt", "a\udcffb", "--device", "cpu"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert err.startswith("pagedmoe generate: error: prompt ") and "is not UTF-8 text" in err, err


def test_ctrl_c_in_generate_exits_130_quietly(monkeypatch, capsys):
    from pagedmoe.entrypoints import streaming

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(streaming, "stream", interrupted)
    assert main(["generate", "--device", "cpu", "--max-model-len", "128", "--prompt", "x"]) == 130
    assert capsys.readouterr().err.strip() == ""


def _spawn(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "PAGEDMOE_NO_PROGRESS": "1"}
    err = open(tmp_path / "stderr.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "pagedmoe.cli", *args], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=err, env=env, text=True)
    return proc, tmp_path / "stderr.log"


def _wait_for(log: Path, proc, needle: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)


@pytest.mark.parametrize("verb", ["chat", "generate"])
def test_sigint_exits_130_without_a_traceback(tmp_path, verb):
    """A real SIGINT: in chat at its prompt, in generate while it generates (a long greedy run)."""
    # one sequence: a KV cache of 2048 tokens, not 2048 x 256 (3 GiB of zeros, seconds of start-up: the SIGINT to
    # generate then came while the cache was being zeroed, before any token)
    common = ["--device", "cpu", "--max-model-len", "2048", "--max-num-seqs", "1"]
    if verb == "chat":
        proc, log = _spawn(["chat", *common], tmp_path)
        needle = "empty line or Ctrl-D to quit"
    else:
        proc, log = _spawn(["generate", *common, "--prompt", "def f(x):", "--max-tokens", "2000", "--ignore-eos"],
                           tmp_path)
        needle = "experts:"  # the last start-up log line: generation follows
    try:
        _wait_for(log, proc, needle)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral_errors")
    make_tiny_checkpoint("mixtral", path, seed=3, num_hidden_layers=2)
    return path


def _rewrite(src: Path, dst: Path, change) -> None:
    """Copy the checkpoint folder with `change(tensors)` applied to its safetensors file."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})


def _expert_name(tensors) -> str:
    return next(n for n in tensors if ".experts.1." in n or ".experts.gate_up_proj" in n)


@pytest.mark.parametrize("which", ["backbone", "expert"])
def test_wrong_shape_names_file_and_tensor(ckpt, tmp_path, capsys, which):
    from pagedmoe import LLM
    from pagedmoe.models.loader import CheckpointError

    holder = {}

    def shrink(tensors):
        name = "model.norm.weight" if which == "backbone" else _expert_name(tensors)
        tensors[name] = tensors[name][..., :-1].contiguous()
        holder["name"] = name

    bad = tmp_path / "bad"
    _rewrite(ckpt, bad, shrink)
    with pytest.raises(CheckpointError) as info:
        LLM(str(bad), device="cpu", max_model_len=64)
    msg = str(info.value)
    assert msg.startswith("model.safetensors: ") and repr(holder["name"]) in msg and "shape" in msg, msg
    assert main(["generate", str(bad), "--device", "cpu", "--max-model-len", "64", "--prompt", "x"]) == 2
    err = _one_line(capsys.readouterr().err)
    assert holder["name"] in err and "model.safetensors" in err and "truncated" not in err


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_weights_warn_naming_the_tensor(ckpt, tmp_path, caplog, value):
    from pagedmoe import LLM

    names = []

    def poison(tensors):
        for name in ("model.layers.0.self_attn.q_proj.weight", _expert_name(tensors)):
            tensors[name] = tensors[name].clone()
            tensors[name].view(-1)[5] = value
            names.append(name)

    bad = tmp_path / "nan"
    _rewrite(ckpt, bad, poison)
    with caplog.at_level(logging.WARNING, logger="pagedmoe"):
        llm = LLM(str(bad), device="cpu", max_model_len=64)
    warnings = [r.getMessage() for r in caplog.records if "NaN or inf" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith("2 checkpoint tensor(s)"), warnings
    assert all(f"model.safetensors: {n}" in warnings[0] for n in names), warnings
    assert llm.engine.model is not None
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedmoe"):
        LLM(str(ckpt), device="cpu", max_model_len=64)
    assert not [r for r in caplog.records if "NaN or inf" in r.getMessage()]


def test_nonfinite_flag_sees_one_bad_value_in_any_chunk(monkeypatch):
    from pagedmoe.models import loader

    monkeypatch.setattr(loader, "_CHECK_CHUNK", 7)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        w = torch.full((5, 9), 60000.0 if dtype == torch.float16 else 1e30, dtype=dtype)  # big, finite sums
        assert not loader._nonfinite_flag(w)
        for pos in (0, 22, 44):
            for bad in (float("nan"), float("inf"), float("-inf")):
                x = w.clone()
                x.view(-1)[pos] = bad
                assert loader._nonfinite_flag(x), (dtype, pos, bad)
    assert not loader._nonfinite_flag(torch.ones(3, dtype=torch.int64))


def test_expert_stats_folder_is_made_and_an_unwritable_path_refused_before_loading(ckpt, tmp_path, capsys,
                                                                                   monkeypatch):
    """--expert-stats is saved at exit: its folder is made at start (as --output-json's), and a path that cannot
    be written fails in one line before the model loads, not as a warning after the run."""
    import gc
    import json

    from pagedmoe.engine import startup

    argv = ["generate", str(ckpt), "--device", "cpu", "--max-model-len", "64", "--prompt", "x", "--max-tokens", "2"]
    stats = tmp_path / "new" / "sub" / "stats.json"
    assert main([*argv, "--expert-stats", str(stats)]) == 0
    gc.collect()   # the engine's finalizer saves the stats
    assert "total" in json.loads(stats.read_text())
    capsys.readouterr()

    def no_load(*_a, **_k):
        raise AssertionError("the model loaded")

    monkeypatch.setattr(startup, "load_model", no_load)
    (tmp_path / "afile").write_text("")
    for bad, expected in ((tmp_path, "is a folder"), (tmp_path / "afile" / "s.json", "cannot be written")):
        assert main([*argv, "--expert-stats", str(bad)]) == 2
        err = _one_line(capsys.readouterr().err)
        assert err.startswith(f"pagedmoe generate: error: --expert-stats {bad}") and expected in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "new"]   # no probe left behind
