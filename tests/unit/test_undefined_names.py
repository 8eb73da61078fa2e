"""No name in the package is used undefined. Code that runs only on a CUDA device (graph capture, the Triton
launchers' GPU branches) is never executed by the CPU suite, so a name left behind by a change there surfaced only
on the GPU: `PrefillCudaGraphs.capture` logged an undefined `S` after 4cccbaf, and every resident engine with
prefill graphs failed to start on the H100 (2026-12-07). pyflakes reads the source without running it."""
from pathlib import Path

import pyflakes.api
import pyflakes.messages
import pyflakes.reporter

SRC = Path(__file__).resolve().parents[2] / "src" / "pagedmoe"


class _Collect(pyflakes.reporter.Reporter):
    def __init__(self):
        self.found = []

    def flake(self, message):
        self.found.append(message)

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.found.append(f"{filename}:{lineno}: syntax error {msg}")

    def unexpectedError(self, filename, msg):
        self.found.append(f"{filename}: {msg}")


def _undefined(paths) -> list[str]:
    rep = _Collect()
    pyflakes.api.checkRecursive([str(p) for p in paths], rep)
    bad = (pyflakes.messages.UndefinedName, pyflakes.messages.UndefinedLocal, pyflakes.messages.UndefinedExport)
    return [str(m) for m in rep.found if isinstance(m, str) or isinstance(m, bad)]


def test_no_undefined_names_in_the_package():
    assert _undefined([SRC]) == []


def test_the_check_finds_one(tmp_path):
    # the shape of the bug it guards against: a name used in a method after the code defining it moved away
    f = tmp_path / "m.py"
    f.write_text("def capture(self):\n    for T in self.buckets:\n        pass\n    return S, T\n")
    found = _undefined([f])
    assert len(found) == 1 and "undefined name 'S'" in found[0]
