"""generation_config.py: the model's generation_config.json as default sampling parameters (vLLM's
--generation-config auto|vllm|FOLDER and --override-generation-config), and each bad input as one line."""
from __future__ import annotations

import json

import pytest

from pagedmoe.config import default_model_path
from pagedmoe.generation_config import describe, sampling_defaults

QWEN3 = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_k": 20,
         "top_p": 0.95, "transformers_version": "4.51.0"}


def folder(tmp_path, name, content):
    path = tmp_path / name
    path.mkdir()
    (path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_auto_reads_the_models_sampling_keys_only(tmp_path):
    model = folder(tmp_path, "model", {**QWEN3, "max_new_tokens": 512, "min_p": 0.0, "repetition_penalty": 1.05})
    defaults, source = sampling_defaults("auto", None, str(model))
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 512, "min_p": 0.0,
                        "repetition_penalty": 1.05}
    assert source == str(model / "generation_config.json")
    assert describe({"temperature": 0.6, "top_k": 20}) == "temperature=0.6, top_k=20"


def test_no_sampling_keys_or_no_file_is_no_defaults(tmp_path):
    # the embedded default model's file has token ids only: requests keep pagedmoe's defaults, as before
    assert sampling_defaults("auto", None, default_model_path()) == ({}, "")
    assert sampling_defaults("auto", None, str(tmp_path)) == ({}, "")   # no file at all
    model = folder(tmp_path, "nulls", {"temperature": None, "top_k": None})
    assert sampling_defaults("auto", None, str(model)) == ({}, "")


def test_vllm_ignores_the_file_and_a_folder_replaces_the_models(tmp_path):
    model = folder(tmp_path, "model", QWEN3)
    other = folder(tmp_path, "other", {"temperature": 0.3, "max_new_tokens": 7})
    assert sampling_defaults("vllm", None, str(model)) == ({}, "")
    defaults, source = sampling_defaults(str(other), None, str(model))
    assert defaults == {"temperature": 0.3, "max_tokens": 7} and source == str(other / "generation_config.json")


def test_override_wins_adds_and_null_drops(tmp_path):
    model = folder(tmp_path, "model", QWEN3)
    defaults, source = sampling_defaults("auto", '{"temperature": 0.1, "min_p": 0.05, "top_k": null}', str(model))
    assert defaults == {"temperature": 0.1, "top_p": 0.95, "min_p": 0.05}
    assert source == f"{model / 'generation_config.json'} and --override-generation-config"
    # with vllm, the override alone (vLLM's); LLM(override_generation_config={...}) gives a dict
    assert sampling_defaults("vllm", {"max_new_tokens": 9}, str(model)) == ({"max_tokens": 9},
                                                                             "--override-generation-config")


@pytest.mark.parametrize("file, override, expected", [
    ({"temperature": -0.5}, None, "generation_config.json: temperature must be >= 0, got -0.5"),
    ({"top_p": 0.0}, None, "generation_config.json: top_p must be in (0, 1], got 0.0"),
    ({"top_p": 1.5}, None, "generation_config.json: top_p must be in (0, 1], got 1.5"),
    ({"top_k": 20.5}, None, "generation_config.json: top_k must be an integer, got 20.5"),
    ({"top_k": -2}, None, "generation_config.json: top_k must be 0 or -1 (disable) or >= 1, got -2"),
    ({"temperature": "hot"}, None, "generation_config.json: temperature must be a number, got 'hot'"),
    ({"temperature": True}, None, "generation_config.json: temperature must be a number, got True"),
    ({"min_p": 2}, None, "generation_config.json: min_p must be in [0, 1], got 2"),
    ({"repetition_penalty": 0}, None, "generation_config.json: repetition_penalty must be > 0, got 0"),
    ({"max_new_tokens": 0}, None, "generation_config.json: max_new_tokens must be >= 1, got 0"),
    ('{"temperature": Infinity}', None, "generation_config.json: temperature must be a finite number, got inf"),
    ('{"temperature": 0.6,', None, "generation_config.json is not valid JSON (Expecting property name"),
    ("[0.6]", None, "generation_config.json: expected a JSON object, got list"),
    (QWEN3, '{"temperature": 0.1', "--override-generation-config is not valid JSON (Expecting ',' delimiter"),
    (QWEN3, "[1]", "--override-generation-config: expected a JSON object, got list"),
    (QWEN3, '{"temp": 1, "max_tokens": 5}', "--override-generation-config: unknown key(s) max_tokens, temp; the "
                                           "sampling keys are temperature, top_p, top_k, min_p, repetition_penalty, "
                                           "max_new_tokens"),
    (QWEN3, '{"top_p": 2}', "--override-generation-config: top_p must be in (0, 1], got 2"),
])
def test_bad_input_is_one_line_naming_where(tmp_path, file, override, expected):
    model = folder(tmp_path, "model", file)
    with pytest.raises(ValueError) as e:
        sampling_defaults("auto", override, str(model))
    message = str(e.value)
    assert "\n" not in message and expected in message, message


def test_a_bad_folder_is_one_line(tmp_path):
    (tmp_path / "file.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    for given, expected in ((tmp_path / "missing", "no such folder"), (tmp_path / "file.json", "is not a folder"),
                            (tmp_path / "empty", "the folder has no generation_config.json")):
        with pytest.raises(ValueError, match=f"^--generation-config {given}.*{expected}"):
            sampling_defaults(str(given), None, str(tmp_path))
