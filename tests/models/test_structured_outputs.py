"""Structured outputs (SamplingParams.structured_outputs, llguidance) on a tiny random checkpoint: unconstrained,
its output is garbage, so every constrained output parsing (a JSON schema's fields, enums and ranges; a regex; a
choice; a Lark grammar; any JSON object) is the constraint at work. Also: greedy is deterministic, n > 1, the
unconstrained requests of a mixed batch get their tokens as alone, --async-scheduling (a constrained request's
step completes before the next: its mask needs the token), preemption and prefix caching, and the refusals (bad
schema / regex / grammar, more than one constraint, llguidance missing)."""
from __future__ import annotations

import json
import re
import sys

import pytest

pytest.importorskip("llguidance")

from tiny_models import make_tiny_checkpoint  # noqa: E402

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "enum": ["ann", "bob", "cy"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "y"]}, "maxItems": 3}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-c]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe later"]
LARK = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
PROMPTS = ["hello", "def add(a, b):", "print", "class Point:"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_so")
    make_tiny_checkpoint("qwen3_moe", path, seed=4)
    return str(path)


def _llm(ckpt, **kw):
    from pagedmoe import LLM

    kw.setdefault("async_scheduling", False)
    kw.setdefault("max_model_len", 256)
    return LLM(ckpt, device="cpu", dtype="float32", **kw)


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _so(**kw):
    from pagedmoe import StructuredOutputsParams

    return StructuredOutputsParams(**kw)


def _params(so, **kw):
    from pagedmoe import SamplingParams

    kw.setdefault("max_tokens", 80)
    return SamplingParams(structured_outputs=so, **kw)


def _texts(llm, prompts, params):
    return [c.text for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]


def _check_person(text: str) -> None:
    """SCHEMA by hand: the required fields, their types, the enums and the range, nothing else."""
    obj = json.loads(text)
    assert isinstance(obj, dict) and set(obj) <= {"name", "age", "ok", "tags"} and {"name", "age", "ok"} <= set(obj)
    assert obj["name"] in ("ann", "bob", "cy")
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool) and 0 <= obj["age"] <= 120
    assert isinstance(obj["ok"], bool)
    assert set(obj.get("tags", [])) <= {"x", "y"} and len(obj.get("tags", [])) <= 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema(llm, temperature):
    outs = llm.generate(PROMPTS, _params(_so(json=SCHEMA, disable_any_whitespace=True), temperature=temperature,
                                         seed=5), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        _check_person(o.outputs[0].text)
    # the schema as JSON text is the same constraint
    again = _texts(llm, PROMPTS, _params(_so(json=json.dumps(SCHEMA), disable_any_whitespace=True),
                                         temperature=temperature, seed=5))
    assert again == [o.outputs[0].text for o in outs]


def test_regex_choice_grammar(llm):
    for text in _texts(llm, PROMPTS, _params(_so(regex=REGEX), temperature=1.0, seed=1)):
        assert re.fullmatch(REGEX, text), text
    texts = _texts(llm, PROMPTS, _params(_so(choice=CHOICES), temperature=1.0, seed=2))
    assert all(t in CHOICES for t in texts), texts
    for text in _texts(llm, PROMPTS, _params(_so(grammar=LARK), temperature=1.0, seed=3)):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text


def test_gbnf_grammar(llm):
    gbnf = 'root ::= "[" item ("," item)* "]"\nitem ::= "a" | "bb" | "ccc"'
    for text in _texts(llm, PROMPTS, _params(_so(grammar=gbnf), temperature=1.0, seed=4, max_tokens=40)):
        assert re.fullmatch(r"\[(a|bb|ccc)(,(a|bb|ccc))*\]", text), text


def test_json_object(llm):
    """Any JSON object: a random model may write a string until max_tokens; every output that ends is an object,
    every one is the start of one."""
    prompts = PROMPTS + ["x = ", "import os", "<|user|>\nhi\n<|assistant|>\n", "for i in"]
    outs = llm.generate(prompts, _params(_so(json_object=True, disable_any_whitespace=True), temperature=0.0),
                        use_tqdm=False)
    done = [o.outputs[0].text for o in outs if o.outputs[0].finish_reason == "stop"]
    assert len(done) >= 2, [o.outputs[0].text for o in outs]
    for text in done:
        assert isinstance(json.loads(text), dict), text
    assert all(o.outputs[0].text.startswith("{") for o in outs)


def test_greedy_is_deterministic_and_n_samples_each_constrained(llm):
    so = _so(regex=REGEX)
    first = _texts(llm, PROMPTS, _params(so, temperature=0.0))
    assert _texts(llm, PROMPTS, _params(so, temperature=0.0)) == first
    outs = llm.generate(PROMPTS[:2], _params(_so(json=SCHEMA, disable_any_whitespace=True), n=3, temperature=1.0,
                                             seed=9), use_tqdm=False)
    for o in outs:
        assert len(o.outputs) == 3
        for c in o.outputs:
            _check_person(c.text)
    texts = [c.text for o in outs for c in o.outputs]
    assert len(set(texts)) > 1   # the samples differ: each has its own matcher, not a shared one


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_never_empties_a_constrained_row(llm, temperature):
    """min_tokens bans EOS and the stop tokens; where the grammar allows only those (a complete grammar: EOS; a stop
    token it needs next), the row had no token left: NaN probabilities (a RuntimeError that stopped the engine) or,
    greedy, token 0. The grammar wins (vLLM's): its token is sampled, and the request ends when the grammar is
    complete."""
    tok = llm.engine.tokenizer
    a, b = tok.encode("a"), tok.encode("b")
    assert len(a) == len(b) == 1
    cases = [  # (constraint, extra params, text)
        (_so(choice=[""]), {}, ""),                                       # only EOS, from the first step
        (_so(choice=["ab"]), dict(stop_token_ids=a), "ab"),              # the grammar needs the stop token "a"
        (_so(choice=["ab"]), dict(stop_token_ids=b), "a"),               # ... and ends with one: a stop, its text out
        (_so(regex="x?"), dict(stop_token_ids=tok.encode("x")), ""),
    ]
    for so, extra, text in cases:
        out = llm.generate(["hello"], _params(so, temperature=temperature, seed=1, min_tokens=4, max_tokens=8,
                                              **extra), use_tqdm=False)[0].outputs[0]
        assert (out.text, out.finish_reason) == (text, "stop"), (so, extra, out)
    assert not llm.engine.structured.active


def test_a_grammar_is_built_once_and_copied(llm, monkeypatch):
    """Building a matcher takes ~0.2 s for a large schema, on the engine thread (every stream waits): the n samples of
    a request, and later requests with the same constraint, copy an unused one (~20 us). The copies are independent:
    the same outputs as matchers built anew."""
    import llguidance

    so = _so(json=SCHEMA, disable_any_whitespace=True)
    params = _params(so, n=3, temperature=1.0, seed=5)
    first = [c.text for c in llm.generate(PROMPTS[:2], params, use_tqdm=False)[0].outputs]
    regex = _params(_so(regex=REGEX), n=4, temperature=1.0, seed=1)
    regex.structured_outputs.compiled()   # before LLMatcher is replaced (its static methods compile)
    built, real = [], llguidance.LLMatcher

    def counting(*args, **kwargs):
        built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    again = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [c.text for c in again[0].outputs] == first
    for o in again:
        for c in o.outputs:
            _check_person(c.text)
    llm.generate(PROMPTS, regex, use_tqdm=False)
    assert len(built) <= 1   # the regex's, at most (the schema's is kept from the first call)
    llm.generate(PROMPTS, regex, use_tqdm=False)
    assert len(built) <= 1


def _mixed(llm):
    """A constrained and an unconstrained request beside each other (greedy)."""
    from pagedmoe import SamplingParams

    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return llm.generate(["def add(a, b):", "class Point:", "print"],
                        [plain, _params(_so(regex=REGEX), temperature=0.0), plain], use_tqdm=False)


def test_unconstrained_neighbours_are_unchanged(llm):
    from pagedmoe import SamplingParams

    mixed = _mixed(llm)
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(["def add(a, b):", "print"], plain, use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[1].outputs[0].text)
    assert mixed[1].outputs[0].text == _texts(llm, ["class Point:"], _params(_so(regex=REGEX), temperature=0.0))[0]
    assert not llm.engine.structured.active   # every finished request left the constrained set


def test_async_scheduling_completes_constrained_steps_first(ckpt, llm):
    """--async-scheduling on the CPU (the same order of work, no overlap): the constrained outputs are those of plain
    steps, which they are only if each mask saw the token sampled before it."""
    a = _llm(ckpt, async_scheduling=True)
    assert a.engine._async is not None
    so = _so(json=SCHEMA, disable_any_whitespace=True)
    got = _texts(a, PROMPTS, _params(so, temperature=0.0))
    assert got == _texts(llm, PROMPTS, _params(so, temperature=0.0))
    for text in got:
        _check_person(text)
    assert [o.outputs[0].token_ids for o in _mixed(a)] == [o.outputs[0].token_ids for o in _mixed(llm)]


def test_preemption_and_prefix_caching_keep_the_matcher(ckpt, llm):
    """Few KV blocks: requests are preempted and computed again, their matchers kept (the output tokens are);
    the prompts share a cached prefix. The outputs are those of an engine with room."""
    prompts = ["def add(a, b):\n    return a + b\n" + p for p in ("x", "y", "z", "w", "v", "u")]
    so = _so(json=SCHEMA, disable_any_whitespace=True)
    small = _llm(ckpt, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32, max_model_len=80)
    got = _texts(small, prompts, _params(so, temperature=0.0, max_tokens=45))
    assert small.engine.scheduler.num_preemptions_total > 0
    assert small.engine.kv.prefix_cache_hits > 0
    assert got == _texts(llm, prompts, _params(so, temperature=0.0, max_tokens=45))
    for text in got:
        _check_person(text)


def test_reasoning_end_token_id_delays_the_constraint(ckpt, llm):
    """SamplingParams.reasoning_end_token_id (the server's --reasoning-parser sets </think>'s): until that token is
    sampled the row is free (here logit_bias makes it write a's, then the end token), then the constraint holds;
    from the first token the grammar would allow neither. The same under --async-scheduling."""
    from pagedmoe import SamplingParams

    tok = llm.engine.tokenizer
    a, end = (tok.encode(t, add_special_tokens=False) for t in ("a", "b"))
    assert len(a) == len(end) == 1
    params = _params(_so(choice=CHOICES), temperature=1.0, seed=7, n=3, logit_bias={a[0]: 100, end[0]: 100},
                     reasoning_end_token_id=end[0])
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    texts = [c.text for o in outs for c in o.outputs]
    for text in texts:
        reasoning, _, answer = text.partition("b")
        assert set(reasoning) <= {"a"} and answer in CHOICES, text
    assert any(t.startswith("a") for t in texts)
    ungated = _texts(llm, PROMPTS, _params(_so(choice=CHOICES), temperature=1.0, seed=7, n=3,
                                           logit_bias={a[0]: 100, end[0]: 100}))
    assert all(t in CHOICES for t in ungated), ungated   # without it the grammar holds from the first token
    assert _texts(_llm(ckpt, async_scheduling=True), PROMPTS, params) == texts
    with pytest.raises(ValueError, match="reasoning_end_token_id delays the structured_outputs constraint"):
        SamplingParams(reasoning_end_token_id=end[0])
    with pytest.raises(ValueError, match="non-negative token id"):
        _params(_so(choice=CHOICES), reasoning_end_token_id=-1)


@pytest.mark.parametrize("kw, match", [
    (dict(json={"type": "objectx"}), r"structured_outputs\.json: invalid JSON schema"),
    (dict(json="{not json"), r"structured_outputs\.json"),
    (dict(regex="(unclosed"), r"structured_outputs\.regex: invalid regex"),
    (dict(grammar="start: foo"), r"structured_outputs\.grammar: invalid grammar.*foo"),
    (dict(choice=[]), r"choice must be a non-empty list"),
    (dict(regex="a", choice=["a"]), r"exactly one of .* got regex, choice"),
    (dict(), r"exactly one of .* got none"),
    (dict(structural_tag="{}"), r"structural_tag is not supported"),
    (dict(regex="a", disable_any_whitespace=True), r"json and json_object only"),
    (dict(json="[" * 100_000), r"structured_outputs\.json: the JSON schema is nested too deeply"),  # RecursionError
])
def test_bad_constraints_are_a_value_error(kw, match):
    from pagedmoe import SamplingParams

    with pytest.raises(ValueError, match=match):
        SamplingParams(structured_outputs=_so(**kw))


def test_a_constraint_is_compiled_once(monkeypatch):
    """The server compiles each request's constraint on its event loop (~0.1-0.3 s for a large schema, every stream
    waiting): parameters with a constraint compiled before share its grammar; another one is compiled."""
    import llguidance

    big = {"type": "object", "properties": {f"f{i}": {"type": "string", "pattern": "[a-z]{1,9}@[a-z]+"}
                                            for i in range(50)}}
    grammar = _so(json=big).compiled()
    calls, real = [], llguidance.LLMatcher

    class Counting:
        def __getattr__(self, name):
            calls.append(name)
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    assert _so(json=big).compiled() == grammar and _so(json=json.dumps(big)).compiled()
    assert _so(json=big).compiled() == grammar
    assert calls.count("grammar_from_json_schema") == 1   # the schema as text: another key
    _so(json=big, disable_any_whitespace=True).compiled()
    assert calls.count("grammar_from_json_schema") == 2   # other options: another grammar


def test_structured_outputs_must_be_the_params_type(llm):
    from pagedmoe import SamplingParams

    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})
    assert not llm.engine.structured.active and not llm.engine.requests


def test_without_llguidance_a_constraint_fails_in_one_line(monkeypatch, llm):
    from pagedmoe import SamplingParams

    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance now fails
    with pytest.raises(ValueError, match=r"^structured outputs need the llguidance package.*pip install llguidance"
                                         r"[^\n]*$"):
        SamplingParams(structured_outputs=_so(regex="[a-z]+"))
    # unconstrained use is unaffected
    out = llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_token_bitmask_unpacks_llguidance_layout():
    """Bit t % 32 of word t // 32 allows token t; logits columns past the tokenizer's tokens are never allowed."""
    import torch

    from pagedmoe.worker.token_mask import allowed_tokens, apply_token_bitmask

    allowed = {0: [0, 5, 31, 32, 63, 70], 1: [1, 64, 65]}
    bitmask = torch.zeros((2, 3), dtype=torch.int32)   # 96 tokens
    for row, tokens in allowed.items():
        for t in tokens:
            word = int(bitmask[row, t // 32]) & 0xFFFFFFFF | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word
    unpacked = allowed_tokens(bitmask, 100)
    assert unpacked.shape == (2, 100)
    for row, tokens in allowed.items():
        assert unpacked[row].nonzero().flatten().tolist() == tokens
    logits = torch.randn(3, 100)
    out = apply_token_bitmask(logits, [2, 0], bitmask, num_tokens=64)
    assert torch.equal(out[1], logits[1])                                 # an unconstrained row
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [0, 5, 31, 32, 63]   # 70: past the tokenizer
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1]
    assert out[2, 5] == logits[2, 5]


@pytest.mark.gpu
def test_cuda_async_scheduling_and_graphs(ckpt):
    """On CUDA (bf16, decode CUDA graphs, --async-scheduling on by default with resident experts): every
    constrained output satisfies its constraint, greedy outputs are those of plain steps, and an unconstrained
    neighbour's greedy tokens are those it gets alone."""
    import torch
    from pagedmoe import LLM, SamplingParams

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    so = _so(json=SCHEMA, disable_any_whitespace=True)
    runs = {}
    for async_on in (True, False):
        llm = LLM(ckpt, device="cuda", dtype="bfloat16", max_model_len=256, async_scheduling=async_on)
        assert (llm.engine._async is not None) == async_on
        runs[async_on] = (_texts(llm, PROMPTS, _params(so, temperature=0.0)),
                          [o.outputs[0].token_ids for o in _mixed(llm)])
        for text in runs[async_on][0]:
            _check_person(text)
        plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        alone = llm.generate(["def add(a, b):"], plain, use_tqdm=False)[0].outputs[0].token_ids
        assert runs[async_on][1][0] == alone
        # the reasoning gate (reasoning_end_token_id): free until the end token, the choice after it
        tok = llm.engine.tokenizer
        a, end = (tok.encode(t, add_special_tokens=False)[0] for t in ("a", "b"))
        gated = _texts(llm, PROMPTS, _params(_so(choice=CHOICES), temperature=1.0, seed=7,
                                             logit_bias={a: 100, end: 100}, reasoning_end_token_id=end))
        for text in gated:
            reasoning, _, answer = text.partition("b")
            assert set(reasoning) <= {"a"} and answer in CHOICES, text
        runs[async_on] += (gated,)
        del llm
    assert runs[True] == runs[False]
