"""What every benchmark result records besides its numbers: versions, git commit, GPU, and the file."""
from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
from datetime import datetime
from importlib import metadata
from pathlib import Path
from typing import Any, Optional


def git_commit() -> Optional[str]:
    """The commit of the checkout pagedmoe runs from (None when not a git checkout)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def versions(*packages: str) -> dict[str, Optional[str]]:
    out = {"python": platform.python_version()}
    for name in ("pagedmoe", "torch", "triton", "transformers", *packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def gpu_name() -> Optional[str]:
    """The local GPU's name, without importing torch when it is not loaded already (a client needs no torch)."""
    torch = sys.modules.get("torch")
    if torch is None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
        except (OSError, subprocess.SubprocessError):
            return None
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def environment(*packages: str) -> dict[str, Any]:
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "git_commit": git_commit(), "gpu_name": gpu_name(),
            "hostname": platform.node(), "versions": versions(*packages)}


def jsonable(value: Any) -> Any:
    """JSON has no inf/nan: write them as strings ("inf"), as vLLM does for --request-rate inf."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, result: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(jsonable(result), indent=2) + "\n")
    return path


def device_memory_line(rec: dict) -> str:
    """One line for the end of a run from a DeviceMemoryMonitor.record(): the process's peak against the budget."""
    text = f"device memory: peak {rec['peak_gib']:.2f} GiB"
    if rec.get("peak_after_stage"):   # where the peak was, and how much of it torch's pool held
        text += (f" (after start-up stage {rec['peak_after_stage']}, torch's pool "
                 f"{rec['torch_reserved_at_peak_gib']:.2f} GiB of it)")
    text += f", {rec['used_gib']:.2f} GiB at the end"
    if rec.get("budget_gib"):
        text += f" (budget {rec['budget_gib']:.2f} GiB: peak {100 * rec['peak_over_budget']:.1f}% of it)"
    text += f"; torch's peak reservation {rec['torch_peak_reserved_gib']:.2f} GiB"
    if "torch_peak_allocated_gib" in rec:   # far below the reservation: the pool is fragmented
        text += f" (peak allocation {rec['torch_peak_allocated_gib']:.2f} GiB)"
    return text
