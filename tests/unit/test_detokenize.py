"""Incremental detokenization (OutputProcessor._detokenize) against decoding the whole output, for a
byte-level BPE tokenizer (the default model's), the tiny test tokenizer and a sentencepiece-style
(Metaspace) one: random token sequences, multi-byte UTF-8 text split over tokens, special tokens kept or
skipped. After every token the text equals the full decode, except while the full decode ends inside a
character (U+FFFD), when it is the full decode less that tail; at the end it is the full decode.
Random token ids only for the byte-level tokenizers: with byte fallback, an invalid byte run turns the
bytes before it into U+FFFD too, so random ids are not text any incremental decoder can follow."""
import random

import pytest

from pagedmoe.engine.output import OutputProcessor
from pagedmoe.engine.request import Request
from pagedmoe.sampling_params import SamplingParams

TEXT = "héllo wörld, 日本語のテキスト 🙂🚀 naïve café — ünïcödé\n\tdef f(x):\n    return x ** 2  # ok"


def _default_tokenizer():
    from transformers import AutoTokenizer

    from pagedmoe.config import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def _tiny_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    from tiny_models import save_tokenizer

    save_tokenizer(tmp_path)
    return AutoTokenizer.from_pretrained(tmp_path)


def _metaspace_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "</s>"] + byte_tokens)
    tok.train_from_iterator([TEXT, "the quick brown fox jumps over the lazy dog"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["default", "tiny", "metaspace"])
def tokenizer(request, tmp_path_factory):
    if request.param == "default":
        return request.param, _default_tokenizer()
    if request.param == "tiny":
        return request.param, _tiny_tokenizer(tmp_path_factory.mktemp("tok"))
    return request.param, _metaspace_tokenizer()


def _sequences(kind, tok, rng):
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    yield enc(TEXT)
    yield enc(TEXT * 2) + [tok.eos_token_id] + enc(" after")
    for _ in range(6):  # random text: words, spaces and multi-byte characters in any order
        yield enc("".join(rng.choice(TEXT) for _ in range(rng.randrange(1, 60))))
    if kind != "metaspace":
        for _ in range(6):
            yield [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 80))]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_is_the_full_decode(tokenizer, skip):
    kind, tokenizer = tokenizer
    proc = OutputProcessor(tokenizer, None, "/nonexistent")
    rng = random.Random(0)
    for ids in _sequences(kind, tokenizer, rng):
        params = SamplingParams(max_tokens=len(ids), ignore_eos=True, skip_special_tokens=skip)
        req = Request("r", [1], params, max_tokens=len(ids))
        for k, t in enumerate(ids, 1):
            status = proc.append_token(req, t, None, None, 0.0)
            full = tokenizer.decode(ids[:k], skip_special_tokens=skip)
            if status is None and full.endswith("\ufffd"):
                assert full.startswith(req.output_text) or full.rstrip("\ufffd").startswith(req.output_text)
            else:
                assert req.output_text == full, (k, ids[:k])
        assert status is not None and req.output_text == tokenizer.decode(ids, skip_special_tokens=skip)


class _Counting:
    """The tokenizer, recording how many ids each decode call is handed."""

    def __init__(self, tokenizer, calls: list):
        self._tok, self._calls = tokenizer, calls

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def decode(self, ids, **kw):
        self._calls.append(len(ids))
        return self._tok.decode(ids, **kw)


def test_decode_cost_does_not_grow_with_the_output(tokenizer):
    """Each step decodes a few tokens, not the whole output: count the tokens handed to decode."""
    tokenizer = tokenizer[1]
    proc = OutputProcessor(tokenizer, None, "/nonexistent")
    decoded = []
    proc.decode = _Counting(tokenizer, decoded).decode
    ids = tokenizer.encode(TEXT * 8, add_special_tokens=False)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True), max_tokens=len(ids))
    for t in ids:
        proc.append_token(req, t, None, None, 0.0)
    assert len(ids) > 150 and max(decoded) <= 8


def test_final_only_decodes_once_at_the_end(tokenizer):
    tokenizer = tokenizer[1]
    proc = OutputProcessor(tokenizer, None, "/nonexistent")
    calls = []
    real = tokenizer.decode
    proc.decode = _Counting(tokenizer, calls).decode
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    req = Request("r", [1], SamplingParams(max_tokens=len(ids), ignore_eos=True, output_kind="final_only"),
                  max_tokens=len(ids))
    for t in ids:
        status = proc.append_token(req, t, None, None, 0.0)
    assert status is not None and calls == [len(ids)] and req.output_text == real(ids, skip_special_tokens=True)
    # with a stop string the text is needed every step: incremental, cut at the match
    stop = TEXT[20:26]
    req = Request("s", [1], SamplingParams(max_tokens=len(ids), stop=[stop], output_kind="final_only"),
                  max_tokens=len(ids))
    for t in ids:
        if proc.append_token(req, t, None, None, 0.0) is not None:
            break
    assert req.output_text == TEXT[:20] or req.output_text == real(ids, skip_special_tokens=True).split(stop)[0]


@pytest.mark.parametrize("clean_up", [False, True])
def test_fast_decode_equals_tokenizer_decode(clean_up):
    """The Rust backend called directly gives tokenizer.decode's text (a tokenizer that cleans up spaces
    keeps the wrapper), for random ids with special tokens kept and skipped."""
    from pagedmoe.engine.output import _fast_decode

    tok = _default_tokenizer()
    tok.clean_up_tokenization_spaces = clean_up
    decode = _fast_decode(tok)
    assert (decode == tok.decode) == clean_up
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 24))] + rng.sample(special, min(2, len(special)))
        rng.shuffle(ids)
        for skip in (False, True):
            assert decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
