"""The server driven by the official `openai` client, checked against the offline engine (same weights)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from server_utils import MAX_MODEL_LEN, MODEL_NAME

openai = pytest.importorskip("openai")  # the serve extra; the GPU machine has none

PROMPT = "def add(a, b):"


def greedy(ref, prompt, max_tokens, **kw):
    from pagedmoe import SamplingParams

    out = ref.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]
    return out.outputs[0]


def test_models_health_version(server):
    models = httpx.get(server.base_url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]


def test_completion_matches_offline_engine(server, client, ref):
    want = greedy(ref, PROMPT, 12, ignore_eos=True)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL_NAME
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    # The same prompt as token ids (vLLM's list-of-ints prompt) gives the same completion.
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r2 = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert r2.choices[0].text == want.text and r2.usage.prompt_tokens == len(ids)


def test_batch_of_prompts_and_echo(client, ref):
    prompts = [PROMPT, "class Point:"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=5, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    for c in r.choices:
        assert c.text == prompts[c.index] + greedy(ref, prompts[c.index], 5, ignore_eos=True).text
    assert r.usage.completion_tokens == 10


def test_chat_matches_offline_chat(client, ref):
    from pagedmoe import SamplingParams

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "print('hello')\nprint(1)"}]
    want = ref.chat(messages, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    # Text parts are joined with newlines, as vLLM's chat_utils joins them for a template that takes a string.
    r2 = client.chat.completions.create(model=MODEL_NAME, max_tokens=10, temperature=0,
                                        messages=[messages[0], {"role": "user", "content": [
                                            {"type": "text", "text": "print('hello')"},
                                            {"type": "text", "text": "print(1)"}]}],
                                        extra_body={"ignore_eos": True})
    assert r2.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r2.choices[0].message.content == want.outputs[0].text


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo(client, stream):
    # vLLM's chat `echo`: the last message's content goes before each reply when it has the reply's role
    # (the assistant's, or with add_generation_prompt false the last message's own); else nothing is echoed.
    user, prefix = {"role": "user", "content": "print("}, {"role": "assistant", "content": "def "}
    cases = [([user, prefix], {"add_generation_prompt": False, "continue_final_message": True}, "def "),
             ([user, prefix], {}, "def "),
             ([user], {}, ""),
             ([user], {"add_generation_prompt": False}, "print(")]
    for messages, flags, echoed in cases:
        kw = dict(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, n=2)
        plain = client.chat.completions.create(extra_body={"ignore_eos": True, **flags}, **kw)
        if not stream:
            r = client.chat.completions.create(extra_body={"ignore_eos": True, "echo": True, **flags}, **kw)
            texts = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
        else:
            texts = ["", ""]
            for chunk in client.chat.completions.create(stream=True, extra_body={"ignore_eos": True, "echo": True,
                                                                                  **flags}, **kw):
                for c in chunk.choices:
                    texts[c.index] += c.delta.content or ""
        assert texts == [echoed + c.message.content for c in sorted(plain.choices, key=lambda c: c.index)], flags


@pytest.mark.parametrize("stream", [False, True])
def test_chat_reply_role(client, stream):
    # vLLM's get_chat_request_role: the assistant's after a generation prompt, else the last message's role.
    user, prefix = {"role": "user", "content": "print("}, {"role": "assistant", "content": "def "}
    cases = [([user], {}, "assistant"), ([user], {"add_generation_prompt": False}, "user"),
             ([user, prefix], {"add_generation_prompt": False, "continue_final_message": True}, "assistant")]
    for messages, flags, role in cases:
        kw = dict(model=MODEL_NAME, messages=messages, max_tokens=2, n=2, extra_body=flags)
        if not stream:
            assert [c.message.role for c in client.chat.completions.create(**kw).choices] == [role, role], flags
        else:
            roles = [c.delta.role for chunk in client.chat.completions.create(stream=True, **kw)
                     for c in chunk.choices if c.delta.role]
            assert roles == [role, role], flags


def test_streaming_completion_with_usage(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text_chunks, last = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert all(c.usage is None for c in text_chunks)
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_chat_with_usage_ends_with_done(server, client):
    messages = [{"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    # The raw stream: `data: {json}` events separated by blank lines, the last one `data: [DONE]`.
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence(client, ref, stream):
    text = greedy(ref, PROMPT, 16, ignore_eos=True).text
    stop = text[4:6]
    assert stop and stop in text
    want = text[: text.index(stop)]
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        got, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kwargs)
        got, reason = r.choices[0].text, r.choices[0].finish_reason
    assert got == want and reason == "stop"
    r = client.completions.create(**{**kwargs, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}})
    assert r.choices[0].text == want + stop


def test_seeded_sampling_is_reproducible_under_load(server, client):
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, extra_body={"ignore_eos": True})
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert a == b and a != c

    async def together():
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
        others = [aclient.completions.create(**{**kwargs, "max_tokens": 8}) for _ in range(4)]
        mine = aclient.completions.create(seed=1234, **kwargs)
        results = await asyncio.gather(mine, *others)
        await aclient.close()
        return results[0].choices[0].text

    assert asyncio.run(together()) == a  # other requests in the batch do not change a seeded stream


def test_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 4 and token_lp <= 0  # decoded strings of different tokens may collide
        assert token_lp == pytest.approx(max(top.values()))  # greedy picks the most likely token

    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.bytes == list(entry.token.encode())

    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in content])


def test_tokenize_detokenize_roundtrip(server):
    ids = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) and ids["max_model_len"] == MAX_MODEL_LEN
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"]
    assert text == PROMPT
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2


@pytest.fixture(scope="module")
def bos_server(tiny_model_dir, tmp_path_factory):
    """A server on a copy of the checkpoint whose tokenizer prepends a BOS (the tiny one adds no special tokens):
    yields the server, that tokenizer and the BOS id."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    from server_utils import ServerThread, make_engine

    path = tmp_path_factory.mktemp("tiny_bos")
    shutil.copytree(tiny_model_dir, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                              special_tokens=[("<|endoftext|>", bos)])
    tok.save_pretrained(path)
    with ServerThread(make_engine(path, max_num_seqs=2)) as server:
        yield server, tok, bos


def test_tokenize_add_special_tokens(bos_server):
    # vLLM: add_special_tokens defaults to True for a prompt and False for messages (the chat template writes
    # its own BOS); sent with messages, it adds the tokenizer's special tokens on top of the template's.
    server, tok, bos = bos_server
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "def"}]

    def tokens(**body):
        r = httpx.post(server.base_url + "/tokenize", json=body)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    plain = tokens(prompt=PROMPT, add_special_tokens=False)
    assert tokens(prompt=PROMPT) == tokens(prompt=PROMPT, add_special_tokens=True) == [bos] + plain
    chat = tokens(messages=messages)
    assert bos not in chat and tokens(messages=messages, add_special_tokens=False) == chat
    assert tokens(messages=messages, add_special_tokens=True) == [bos] + chat
    # continue_final_message (vLLM's tokenize field) leaves the last message open.
    assert tokens(messages=messages, add_generation_prompt=False, continue_final_message=True) == \
        tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True), add_special_tokens=False)


def test_chat_add_special_tokens(bos_server):
    # vLLM's chat field (default false): true encodes the rendered template with the tokenizer's special tokens.
    server, _, bos = bos_server
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()["tokens"]
    for flag, want in [(None, chat), (False, chat), (True, [bos] + chat)]:
        body = {"messages": messages, "max_tokens": 1, **({} if flag is None else {"add_special_tokens": flag})}
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(want), flag
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": messages, "add_special_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens", r.text


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_text_is_left_out(client, ref, stream):
    # vLLM: the text of the token that stopped the request (a stop_token_ids entry, or EOS with
    # skip_special_tokens false) is left out unless include_stop_str_in_output; the token itself counts.
    tok = ref.get_tokenizer()
    ids = greedy(ref, PROMPT, 8, ignore_eos=True).token_ids
    stop = next(t for t in ids[1:] if tok.decode([t]).strip())
    cut = ids[:ids.index(stop)]
    eos = ref.engine.outputs.eos_token_ids
    cases = [({"stop_token_ids": [stop], "ignore_eos": True}, tok.decode(cut), len(cut) + 1, stop),
             ({"stop_token_ids": [stop], "ignore_eos": True, "include_stop_str_in_output": True},
              tok.decode(cut + [stop]), len(cut) + 1, stop),
             ({"logit_bias": {str(min(eos)): 100}, "skip_special_tokens": False}, "", 1, None)]
    for extra, text, num_tokens, stop_reason in cases:
        kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, extra_body=extra)
        if stream:
            chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
            got = "".join(c.choices[0].text for c in chunks if c.choices)
            last = [c.choices[0] for c in chunks if c.choices][-1]
            usage = chunks[-1].usage
        else:
            r = client.completions.create(**kwargs)
            got, last, usage = r.choices[0].text, r.choices[0], r.usage
        assert (got, last.finish_reason, usage.completion_tokens) == (text, "stop", num_tokens), extra
        assert getattr(last, "stop_reason", None) == stop_reason


def test_stop_string_before_min_tokens_is_ignored(client, ref):
    # vLLM: stop strings are not checked for the first min_tokens tokens, and later only in the new text,
    # so a stop string written before min_tokens never ends (nor cuts) the output.
    tok = ref.get_tokenizer()
    want = greedy(ref, PROMPT, 8, ignore_eos=True)
    head = tok.decode(want.token_ids[:3])
    stop = next(s for s in (tok.decode([t]) for t in want.token_ids[:3]) if s.strip() and want.text.count(s) == 1
                and want.text.index(s) + len(s) <= len(head))
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True, "min_tokens": 4})
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "length")
