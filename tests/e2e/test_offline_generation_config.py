"""The model's generation_config.json as default sampling parameters offline: LLM.get_default_sampling_params and
LLM.generate without parameters, `pagedmoe generate`'s flags left out, the flags and PAGEDMOE_* variables, and a bad
--generation-config / --override-generation-config as one line before the model loads."""
from __future__ import annotations

import json
import logging

import pytest

from pagedmoe.cli import main
from tiny_models import make_tiny_checkpoint

FILE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5}
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")


def sampling(params) -> dict:
    return {name: getattr(params, name) for name in FIELDS}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A tiny checkpoint whose generation_config.json has token ids only (as the embedded model's), and beside it
    `gencfg/`, a folder holding only a generation_config.json that adds sampling fields to those."""
    root = tmp_path_factory.mktemp("models")
    make_tiny_checkpoint("qwen3_moe", root / "plain", seed=3)
    ids = json.loads((root / "plain" / "generation_config.json").read_text())
    (root / "gencfg").mkdir()
    (root / "gencfg" / "generation_config.json").write_text(json.dumps({**ids, **FILE}))
    return root / "plain"


@pytest.fixture(scope="module")
def gen_dir(plain):
    return plain.parent / "gencfg"


@pytest.fixture
def submitted(monkeypatch):
    """The SamplingParams of every request the engine is given."""
    from pagedmoe.engine.llm_engine import LLMEngine

    sent = []
    add = LLMEngine.add_request

    def spy(self, request_id, prompt, params, prompt_token_ids=None):
        sent.append(params)
        return add(self, request_id, prompt, params, prompt_token_ids=prompt_token_ids)

    monkeypatch.setattr(LLMEngine, "add_request", spy)
    return sent


def test_llm_defaults_from_a_folder_and_generate_without_parameters(plain, gen_dir, submitted, caplog):
    from pagedmoe import LLM, SamplingParams

    with caplog.at_level(logging.INFO, logger="pagedmoe"):
        llm = LLM(str(plain), device="cpu", max_model_len=96, generation_config=str(gen_dir))
    line = next(r.getMessage() for r in caplog.records if "default sampling parameters" in r.getMessage())
    assert str(gen_dir / "generation_config.json") in line and "temperature=0.6" in line and "max_tokens=5" in line
    want = SamplingParams(temperature=0.6, top_p=0.95, top_k=20, repetition_penalty=1.1, max_tokens=5)
    assert llm.get_default_sampling_params() == want
    out = llm.generate("def f(x):", use_tqdm=False)[0].outputs[0]
    assert sampling(submitted[-1]) == sampling(want) and 1 <= len(out.token_ids) <= 5
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert sampling(submitted[-1]) == sampling(want)
    explicit = SamplingParams(temperature=0.0, max_tokens=3)   # given parameters are used as they are
    llm.generate("def f(x):", explicit, use_tqdm=False)
    assert submitted[-1].temperature == 0.0 and submitted[-1].top_k == -1 and submitted[-1].max_tokens == 3


def test_llm_without_sampling_fields_is_unchanged_and_override_takes_a_dict(plain, gen_dir, caplog):
    from pagedmoe import LLM, SamplingParams

    with caplog.at_level(logging.INFO, logger="pagedmoe"):
        llm = LLM(str(plain), device="cpu", max_model_len=96)
    assert llm.engine.default_sampling_params == {} and llm.get_default_sampling_params() == SamplingParams()
    assert not any("default sampling parameters" in r.getMessage() for r in caplog.records)
    llm = LLM(str(plain), device="cpu", max_model_len=96, generation_config=str(gen_dir),
              override_generation_config={"temperature": 0.1, "max_new_tokens": None})
    assert llm.engine.default_sampling_params == {"temperature": 0.1, "top_p": 0.95, "top_k": 20,
                                                  "repetition_penalty": 1.1}
    assert llm.get_default_sampling_params().max_tokens == 16   # SamplingParams' own, as vLLM's


def _generate(model, tmp_path, *flags) -> list[dict]:
    out = tmp_path / "out.json"
    assert main(["generate", str(model), "--prompt", "def f(x):", "--device", "cpu", "--max-model-len", "96",
                 "--output-json", str(out), *flags]) == 0
    return json.loads(out.read_text())


def test_generate_cli_flags_left_out_take_the_models_defaults(plain, gen_dir, submitted, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDMOE_GENERATION_CONFIG", str(gen_dir))   # every engine flag reads PAGEDMOE_*
    (out,) = _generate(plain, tmp_path, "--ignore-eos")
    assert sampling(submitted[-1]) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                       "repetition_penalty": 1.1, "max_tokens": 5}
    assert len(out["token_ids"]) == 5
    # a flag given wins; the others still come from the file
    (out,) = _generate(plain, tmp_path, "--ignore-eos", "--temperature", "0", "--max-tokens", "3", "--top-k", "0")
    assert sampling(submitted[-1]) == {"temperature": 0.0, "top_p": 0.95, "top_k": 0, "min_p": 0.0,
                                       "repetition_penalty": 1.1, "max_tokens": 3}
    assert len(out["token_ids"]) == 3
    # --generation-config vllm (the flag wins over the variable): generate's own defaults, greedy and 64 tokens
    _generate(plain, tmp_path, "--generation-config", "vllm", "--max-tokens", "2")
    assert sampling(submitted[-1]) == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                       "repetition_penalty": 1.0, "max_tokens": 2}
    monkeypatch.delenv("PAGEDMOE_GENERATION_CONFIG")
    _generate(plain, tmp_path, "--override-generation-config", '{"top_p": 0.5}')
    assert sampling(submitted[-1]) == {"temperature": 0.0, "top_p": 0.5, "top_k": -1, "min_p": 0.0,
                                       "repetition_penalty": 1.0, "max_tokens": 64}


@pytest.mark.parametrize("flags, expected", [
    (["--generation-config", "/no/such/folder"], "--generation-config /no/such/folder: no such folder"),
    (["--override-generation-config", "{temperature: 1}"], "--override-generation-config is not valid JSON"),
    (["--override-generation-config", '{"temp": 1}'], "--override-generation-config: unknown key(s) temp;"),
    (["--override-generation-config", '{"temperature": -1}'],
     "--override-generation-config: temperature must be >= 0, got -1"),
])
@pytest.mark.parametrize("verb", ["generate", "serve"])
def test_bad_flags_are_one_line_before_the_model_loads(capsys, monkeypatch, verb, flags, expected):
    from pagedmoe.engine import llm_engine

    def never(*_args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "start_engine", never)
    args = ["--prompt", "x"] if verb == "generate" else []
    assert main([verb, *args, "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"pagedmoe {verb}: error: {expected}"), err
