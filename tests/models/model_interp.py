"""Whole tiny models through Triton kernels on a machine without CUDA: Triton's interpreter, with the fixes of
tests/kernels/triton_interp.py. Import this module before anything imports triton: triton.jit picks the
interpreter when a kernel is decorated."""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def fix_interpreter(bf16_dot: bool = False) -> None:
    """Under the interpreter: its index, bf16 cast (and with `bf16_dot`, bf16 dot) fixes; on a GPU nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "kernels"))
    from triton_interp import fix_interpreter_bf16, fix_interpreter_bf16_dot, fix_interpreter_index

    fix_interpreter_index()
    fix_interpreter_bf16()
    if bf16_dot:
        fix_interpreter_bf16_dot()


def greedy_against_transformers(hf, prompt, step_logits, label: str, tol: float = 1e-4) -> list[int]:
    """Each step's logits of the first sequence (`step_logits[i][0]`) against transformers' full forward on the
    prompt and the tokens so far, greedy; returns the tokens transformers generated."""
    tokens = list(prompt)
    with torch.no_grad():
        for i, logits in enumerate(step_logits):
            ref = hf(torch.tensor([tokens])).logits[0, -1].float()
            diff = (logits[0] - ref).abs().max().item()
            assert diff <= tol, f"{label} step {i}: max abs diff {diff} against transformers"
            tokens.append(int(ref.argmax()))
    return tokens[len(prompt):]
