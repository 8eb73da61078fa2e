"""n > 1, penalties, logit_bias and seeds through the official `openai` client, checked against the offline
engine (same weights, same parameters); prefix caching seen in /metrics."""
from __future__ import annotations

import pytest

from server_utils import MODEL_NAME

pytest.importorskip("openai")  # the serve extra

PROMPT = "for i in range(10):"
MESSAGES = [{"role": "user", "content": "Tell me about points."}]


def offline(ref, prompt, **kw):
    from pagedmoe import SamplingParams

    return ref.generate([prompt], SamplingParams(ignore_eos=True, **kw), use_tqdm=False)[0].outputs


def test_completions_n3_seeded_match_offline(client, ref):
    want = offline(ref, PROMPT, n=3, temperature=1.0, seed=11, max_tokens=8)
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, n=3, temperature=1.0, seed=11, max_tokens=8,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w.text for w in want]
    assert len({c.text for c in r.choices}) > 1  # three different samples (seeds 11, 12, 13)
    n_prompt = len(ref.get_tokenizer().encode(PROMPT))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 24


def test_completions_n2_two_prompts_prompt_major(client, ref):
    prompts = [PROMPT, "class Point:"]
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, temperature=0.8, seed=3, max_tokens=5,
                                  extra_body={"ignore_eos": True})
    want = [w.text for p in prompts for w in offline(ref, p, n=2, temperature=0.8, seed=3, max_tokens=5)]
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and [c.text for c in r.choices] == want


def test_penalties_match_offline(client, ref):
    kw = dict(temperature=0.0, max_tokens=24, presence_penalty=0.8, frequency_penalty=1.2)
    want = offline(ref, PROMPT, **kw)[0]
    plain = offline(ref, PROMPT, temperature=0.0, max_tokens=24)[0]
    assert want.token_ids != plain.token_ids  # the penalties change this greedy output
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, extra_body={"ignore_eos": True}, **kw)
    assert r.choices[0].text == want.text
    rep = offline(ref, PROMPT, temperature=0.0, max_tokens=24, repetition_penalty=1.7)[0]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0.0, max_tokens=24,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.7})
    assert r.choices[0].text == rep.text and rep.token_ids != plain.token_ids


def test_logit_bias_forces_a_token(client, ref):
    tok = ref.get_tokenizer()
    target = tok.encode("x")[-1]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0.0, max_tokens=6,
                                  logit_bias={str(target): 100}, logprobs=1, extra_body={"ignore_eos": True})
    assert r.choices[0].text == tok.decode([target] * 6)
    banned = offline(ref, PROMPT, temperature=0.0, max_tokens=1)[0].token_ids[0]
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0.0, max_tokens=1,
                                  logit_bias={str(banned): -100}, logprobs=0, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens[0] != tok.decode([banned])


def test_chat_n3_streamed_equals_whole(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, n=3, temperature=1.0, seed=5, max_tokens=8,
              frequency_penalty=0.5, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = ["", "", ""]
    finished = set()
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
        if chunk.usage is not None:
            usage = chunk.usage
    assert finished == {0, 1, 2} and texts == [c.message.content for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == 24


def test_prefix_cache_metrics(server, client):
    server.wait_idle()
    before = server.metrics()
    long = "def add(a, b):\n    return a + b\n" * 4
    for _ in range(2):
        client.completions.create(model=MODEL_NAME, prompt=long, max_tokens=2, temperature=0)
    m = server.wait_idle()
    hits = m["pagedmoe:prefix_cache_hits_total"] - before["pagedmoe:prefix_cache_hits_total"]
    queries = m["pagedmoe:prefix_cache_queries_total"] - before["pagedmoe:prefix_cache_queries_total"]
    assert hits >= 16 and queries > hits


def test_completions_n2_streamed_equals_whole(client):
    kw = dict(model=MODEL_NAME, prompt=[PROMPT, "x = 1"], n=2, temperature=1.0, seed=9, max_tokens=6,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    texts = [""] * 4
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in whole.choices]


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_is_per_choice(client, chat):
    # vLLM: with continuous_usage_stats each chunk's usage is its choice's: that choice's prompt and the
    # tokens it has generated so far (not the sum over the request's choices).
    kw = dict(model=MODEL_NAME, n=2, temperature=1.0, seed=4, max_tokens=5, stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kw))
        num_prompts = 1
    else:
        chunks = list(client.completions.create(prompt=[PROMPT, "x = 1"], **kw))
        num_prompts = 2
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens == 5 * 2 * num_prompts
    seen: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        seen.setdefault(choice.index, []).append((chunk.usage.prompt_tokens, chunk.usage.completion_tokens))
    assert sorted(seen) == list(range(2 * num_prompts))
    prompt_tokens = {i: counts[-1][0] for i, counts in seen.items()}
    assert sum(prompt_tokens[i] for i in range(0, 2 * num_prompts, 2)) == final.prompt_tokens
    for i, counts in seen.items():
        assert counts[-1][1] == 5 and all(p == prompt_tokens[i] for p, _ in counts)
        assert [c for _, c in counts] == sorted(c for _, c in counts)


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_needs_include_usage(client, chat):
    # vLLM sends per-chunk usage only when include_usage and continuous_usage_stats are both true.
    kw = dict(model=MODEL_NAME, max_tokens=3, stream=True, stream_options={"continuous_usage_stats": True},
              extra_body={"ignore_eos": True})
    if chat:
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kw))
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kw))
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)
