"""Every GPU benchmark script at least parses: most of them only run on the device machine, where a syntax
error would cost a call of the session's device time."""
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


def test_the_scripts_are_found():
    assert len(SCRIPTS) > 20 and any(p.name == "tune_prefill_attention.py" for p in SCRIPTS)


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_script_parses(path):
    compile(path.read_text(), str(path), "exec")
