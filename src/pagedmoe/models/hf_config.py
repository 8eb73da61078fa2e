"""A checkpoint folder's config.json, read as a transformers config (no torch, no weights)."""
from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be used, with the reason."""


def load_hf_config(path: str):
    from transformers import AutoConfig

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {path!r} does not exist (models are read from local folders)")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: no config.json")
    try:
        json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many kinds here
        raise CheckpointError(f"{cfg_file}: cannot be read as a transformers config ({e})") from e
