"""The model's generation_config.json as the default sampling parameters (vLLM's `--generation-config` and
`--override-generation-config`): read and checked here, once, when the engine starts.

A request (HTTP, `LLM.generate` without parameters, `pagedmoe generate` / `chat`) that leaves one of these fields
out takes the default; a value it sets wins. Only the sampling keys below are taken from the file (its token ids and
other keys are for others: engine/output.py reads `eos_token_id`); `max_new_tokens` is the default `max_tokens`.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Union

from pagedmoe.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# the file's sampling keys (Hugging Face's names) -> SamplingParams fields
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                 "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
OVERRIDE_FLAG = "--override-generation-config"


def sampling_defaults(generation_config: str, override: Union[str, dict, None],
                      model_path: str) -> tuple[dict[str, Any], str]:
    """(SamplingParams field -> default, where they came from for the start-up line); ({}, "") for none.

    generation_config: "auto" (the model folder's file, none there: no defaults), "vllm" (no file: only the
    override) or a folder holding the file. override: a JSON object (text, or a dict from `LLM(...)`) of sampling
    keys whose values replace the file's (null drops one). Anything wrong is a one-line ValueError."""
    sources, merged = [], {}
    if generation_config != "vllm":
        path = _file_path(generation_config, model_path)
        if path is not None:
            merged = _checked(_read_object(path), str(path), strict=False)
            if any(v is not None for v in merged.values()):
                sources.append(str(path))
    if override is not None:
        values = _checked(_parse_override(override), OVERRIDE_FLAG, strict=True)
        merged.update(values)
        if any(v is not None for v in values.values()):
            sources.append(OVERRIDE_FLAG)
    defaults = {SAMPLING_KEYS[key]: value for key, value in merged.items() if value is not None}
    return defaults, " and ".join(sources) if defaults else ""


def describe(defaults: dict[str, Any]) -> str:
    """"temperature=0.6, top_p=0.95" (the start-up line's list)."""
    return ", ".join(f"{name}={value}" for name, value in defaults.items())


def _file_path(generation_config: str, model_path: str) -> Optional[Path]:
    """The file to read: the model folder's (None if it has none) or the given folder's (which must hold one)."""
    if generation_config == "auto":
        path = Path(model_path) / FILE_NAME
        return path if path.is_file() else None
    folder = Path(generation_config)
    flag = f"--generation-config {generation_config}"
    if not folder.exists():
        raise ValueError(f"{flag}: no such folder (auto: the model's {FILE_NAME}; vllm: none)")
    if not folder.is_dir():
        raise ValueError(f"{flag} is not a folder: give the folder that holds {FILE_NAME}")
    if not (folder / FILE_NAME).is_file():
        raise ValueError(f"{flag}: the folder has no {FILE_NAME}")
    return folder / FILE_NAME


def _read_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot be read ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _parse_override(override: Union[str, dict]) -> dict:
    value = override
    if isinstance(override, str):
        try:
            value = json.loads(override)
        except json.JSONDecodeError as e:
            raise ValueError(f"{OVERRIDE_FLAG} is not valid JSON ({e}): give an object such as "
                             '\'{"temperature": 0.5}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"{OVERRIDE_FLAG}: expected a JSON object, got {type(value).__name__}")
    return value


def _checked(values: dict, where: str, strict: bool) -> dict:
    """The sampling keys of `values`, each checked as SamplingParams checks its field (None kept: it drops a
    default). strict: other keys are an error naming them (the override); else they are left out (the file)."""
    unknown = sorted(set(values) - set(SAMPLING_KEYS))
    if strict and unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(str, unknown))}; the sampling keys are "
                         f"{', '.join(SAMPLING_KEYS)}")
    out = {}
    for key, field in SAMPLING_KEYS.items():
        if key not in values:
            continue
        value = out[key] = values[key]
        if value is None:
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{where}: {key} must be a finite number, got {value}")
        try:
            SamplingParams(**{field: value})
        except ValueError as e:  # "max_tokens must be >= 1, got 0" -> named as the file names it
            message = str(e)
            raise ValueError(f"{where}: {key + message[len(field):] if message.startswith(field) else message}") \
                from None
    return out
