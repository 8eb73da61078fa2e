"""The README's first command runs on the base install, which has no triton (a GPU extra): the main job on
the embedded default model must not import it. Checked by making `import triton` fail in a fresh process."""
from __future__ import annotations

import os
import subprocess
import sys

CHILD = r"""
import sys
sys.modules["triton"] = None          # `import triton` raises ImportError, as where it is not installed
from pagedmoe.cli import main
sys.exit(main(["generate", "--prompt", "def fibonacci(n):", "--max-tokens", "4", "--device", "cpu"]))
"""


def test_generate_on_the_embedded_model_needs_no_triton():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PAGEDMOE_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generation: 4 tokens" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "triton" not in proc.stderr.lower()
