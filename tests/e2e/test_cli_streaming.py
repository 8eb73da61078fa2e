"""`pagedmoe generate` and `pagedmoe chat` stream: text arrives on stdout while the process still runs; rates
at the end; logprobs printed and in the JSON; --max-tokens beyond the context is the server's error; chat
keeps the conversation inside the context and says what it cut."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tiny_models import make_tiny_checkpoint

SRC = str(Path(__file__).resolve().parents[2] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "PAGEDMOE_NO_PROGRESS": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_checkpoint("qwen3_moe", path, seed=3)
    return str(path)


def _cli(*args):
    return [sys.executable, "-m", "pagedmoe.cli", "--log-level", "WARNING", *args]


def test_generate_streams_before_the_process_ends(ckpt):
    proc = subprocess.Popen(_cli("generate", ckpt, "--prompt", "def add(a, b):", "--max-tokens", "200",
                                 "--ignore-eos", "--device", "cpu", "--max-model-len", "256"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV)
    chunks: list[tuple[float, bytes, bool]] = []  # (arrival, data, process still running)

    def read():
        while True:
            data = os.read(proc.stdout.fileno(), 4096)
            if not data:
                return
            chunks.append((time.monotonic(), data, proc.poll() is None))

    reader = threading.Thread(target=read)
    reader.start()
    proc.wait(timeout=300)
    end = time.monotonic()
    reader.join(timeout=30)
    stderr = proc.stderr.read().decode()
    assert proc.returncode == 0, stderr
    text = b"".join(c[1] for c in chunks).decode()
    assert text.startswith("--- prompt: 'def add(a, b):'\ndef add(a, b):") and "finish_reason=length" in text
    # the generated text came in many pieces, the first long before the end
    header = len("--- prompt: 'def add(a, b):'\ndef add(a, b):".encode())
    got, first_text_at = 0, None
    for t, data, running in chunks:
        got += len(data)
        if got > header and first_text_at is None:
            first_text_at, first_running = t, running
    assert first_text_at is not None and first_running
    assert end - first_text_at > 0.5, (end - first_text_at, len(chunks))
    assert sum(1 for t, _, running in chunks if running) >= 5
    assert "prompt: " in stderr and "generation: 200 tokens" in stderr and "tok/s" in stderr


def test_generate_logprobs_and_context_error(ckpt, tmp_path):
    js = tmp_path / "new" / "out.json"  # its folder is made, as bench and plan make theirs
    r = subprocess.run(_cli("generate", ckpt, "--prompt", "x = 1", "--max-tokens", "4", "--ignore-eos", "--logprobs",
                            "2", "--device", "cpu", "--max-model-len", "64", "--output-json", str(js)),
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    data = json.loads(js.read_text())[0]
    assert data["prompt"] == "x = 1" and len(data["logprobs"]) == 4
    for tid, row in zip(data["token_ids"], data["logprobs"]):
        assert row["token_id"] == tid and len(row["top_logprobs"]) == 2 and row["logprob"] <= 0
        assert row["top_logprobs"][0]["logprob"] >= row["top_logprobs"][1]["logprob"]
    assert data["cumulative_logprob"] == pytest.approx(sum(row["logprob"] for row in data["logprobs"]))
    table = [line for line in r.stdout.splitlines() if "top:" in line]
    assert len(table) == 4
    bad = subprocess.run(_cli("generate", ckpt, "--prompt", "x = 1", "--max-tokens", "5000", "--device", "cpu",
                              "--max-model-len", "64"), capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "maximum context length is 64 tokens. However, you requested" in bad.stderr


def test_chat_streams_and_keeps_within_the_context(ckpt):
    lines = "\n".join(["first question here", "second question, longer than the first one", "third", ""]) + "\n"
    r = subprocess.run(_cli("chat", ckpt, "--device", "cpu", "--max-model-len", "96", "--ignore-eos"),
                       input=lines, capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stderr
    # no --max-tokens: a reply runs until the context is full (not a silent 64-token cut), and says so
    assert "[reply cut at" in r.stderr and "the context is full" in r.stderr
    assert "[context: dropped the" in r.stderr
    assert r.stderr.count("generation: ") >= 2
    r = subprocess.run(_cli("chat", ckpt, "--device", "cpu", "--max-model-len", "96", "--max-tokens", "5",
                            "--ignore-eos"), input="hi\n\n", capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0 and "[reply cut at 5 tokens: --max-tokens]" in r.stderr
    bad = subprocess.run(_cli("chat", ckpt, "--device", "cpu", "--max-model-len", "96", "--max-tokens", "500"),
                         input="hi\n", capture_output=True, text=True, env=ENV, timeout=300)
    assert bad.returncode == 2 and "maximum context length is 96 tokens" in bad.stderr


def test_chat_refuses_a_line_that_is_not_utf8_and_chats_on(ckpt):
    r = subprocess.run(_cli("chat", ckpt, "--device", "cpu", "--max-model-len", "96", "--max-tokens", "3",
                            "--ignore-eos"), input=b"h\xffi\nhello\n\n", capture_output=True, env=ENV, timeout=300)
    stderr = r.stderr.decode()
    assert r.returncode == 0 and "Traceback" not in stderr, stderr
    assert "[this message is not UTF-8 text; not sent]" in stderr and stderr.count("generation: 3 tokens") == 1


def test_chat_line_editing_on_a_terminal(ckpt):
    """On a terminal, chat reads lines with readline: Up recalls the previous message (no `^[[A`)."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child: chat on the pty
        os.execve(sys.executable, _cli("chat", ckpt, "--device", "cpu", "--max-model-len", "96", "--max-tokens",
                                       "3", "--ignore-eos"), ENV)
    seen = b""

    def read_until(marker: bytes, count: int, timeout: float = 120) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(marker) < count:
            assert time.monotonic() < deadline, seen[-2000:]
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    seen += os.read(fd, 4096)
                except OSError:
                    break

    try:
        read_until(b"> ", 1)
        os.write(fd, b"hello there\r")
        read_until(b"tok/s", 1)
        read_until(b"> ", 2)
        time.sleep(0.5)            # typed by a person: readline has the terminal by then
        os.write(fd, b"\x1b[A")    # Up: the previous message comes back, ready to edit
        read_until(b"hello there", 2, timeout=30)
        os.write(fd, b"\r")
        read_until(b"tok/s", 2)
        os.write(fd, b"\r")        # an empty line quits
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    text = seen.decode(errors="replace")
    assert os.WEXITSTATUS(status) == 0, text[-2000:]
    assert "^[[A" not in text and text.count("hello there") >= 2


def test_rates_line_without_a_prefill_or_decode_time():
    # a one-token prompt runs in a decode step and max_tokens 1 has no decode step: no "nan tok/s"
    from pagedmoe.entrypoints.streaming import Rates

    line = Rates(prompt_tokens=1, generated_tokens=1, decode_tokens=0, decode_s=0.0, wall_s=0.1).line()
    assert "nan" not in line and line.count("n/a tok/s") == 2, line
    line = Rates(prompt_tokens=8, cached_tokens=4, prefill_s=0.5, generated_tokens=3, decode_tokens=2,
                 decode_s=0.25, wall_s=1.0).line()
    assert "4 cached, 0.50 s, 8.0 tok/s" in line and "generation: 3 tokens, 0.25 s, 8.0 tok/s" in line, line
