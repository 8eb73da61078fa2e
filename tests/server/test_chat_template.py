"""--chat-template (chat_template.py): a template file or text in place of the tokenizer's, through the engine flag
(the server's /v1/chat/completions and /tokenize, LLM.chat) and LLM.chat(chat_template=...); bad values are one
line before the model loads."""
from __future__ import annotations

import httpx
import pytest

from server_utils import ServerThread, make_engine
from tiny_models import make_tiny_checkpoint

from pagedmoe.chat_template import load_chat_template

# a template unlike the tiny checkpoint's own: every turn as "<role>: text" lines, then "assistant:"
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
RENDERED = "system: be brief\nuser: hi there\nassistant:"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    make_tiny_checkpoint("qwen3_moe", path, seed=3)
    return path


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


def test_text_and_file_give_the_template(template_file):
    assert load_chat_template(None) is None
    assert load_chat_template(TEMPLATE) == TEMPLATE
    assert load_chat_template(str(template_file)) == TEMPLATE


@pytest.mark.parametrize("value, expected", [
    ("", "must be a file holding a Jinja chat template"),
    ("   ", "must be a file holding a Jinja chat template"),
    ("no/such/template.jinja", "no such file 'no/such/template.jinja'"),
    ("{% for m in messages %}{{ m.content }", "not a valid Jinja template (line 1"),
    ("{{ messages[0].content }}\n{% if x %}", "not a valid Jinja template (line 2"),
])
def test_bad_values_are_one_line(value, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")) as e:
        load_chat_template(value)
    assert "\n" not in str(e.value)


def test_bad_files_are_one_line(tmp_path):
    empty = tmp_path / "empty.jinja"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        load_chat_template(str(empty))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="cannot read .* as UTF-8"):
        load_chat_template(str(latin1))
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% if add_generation_prompt %}assistant:")
    with pytest.raises(ValueError, match=r"--chat-template '.*broken.jinja': not a valid Jinja template"):
        load_chat_template(str(broken))


def test_llm_uses_the_flag_and_the_per_call_template(ckpt, template_file):
    from pagedmoe import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=2)
    llm = LLM(str(ckpt), device="cpu", max_model_len=96, chat_template=str(template_file))
    tok = llm.get_tokenizer()
    out = llm.chat(MESSAGES, params, use_tqdm=False)
    assert out[0].prompt_token_ids == tok.encode(RENDERED, add_special_tokens=False)
    # one call's own template wins over the flag's; chat_template_kwargs reach it
    own = "{{ greeting }} {{ messages[-1]['content'] }}"
    out = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=own, chat_template_kwargs={"greeting": "hello"})
    assert out[0].prompt_token_ids == tok.encode("hello hi there", add_special_tokens=False)
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        llm.chat(MESSAGES, params, use_tqdm=False, chat_template="{% if %}")


def test_server_renders_with_the_flags_template(ckpt):
    engine = make_engine(ckpt, device="cpu", chat_template=TEMPLATE)
    with ServerThread(engine) as s:
        r = httpx.post(s.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == engine.tokenizer.encode(RENDERED, add_special_tokens=False)
        r = httpx.post(s.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(engine.tokenizer.encode(RENDERED, add_special_tokens=False))


@pytest.mark.parametrize("verb", ["chat", "serve", "generate"])
def test_cli_refuses_a_bad_template_before_the_model_loads(capsys, monkeypatch, tmp_path, verb):
    from pagedmoe.cli import main
    from pagedmoe.engine import llm_engine

    def never(*_args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(llm_engine, "start_engine", never)
    missing = str(tmp_path / "nope.jinja")
    args = ["--prompt", "x"] if verb == "generate" else []
    assert main([verb, *args, "--device", "cpu", "--chat-template", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"pagedmoe {verb}: error: --chat-template: no such file"), err


def test_a_requests_template_needs_the_trust_flag(ckpt):
    own = "{{ messages[-1]['content'] }} =>"
    body = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0, "chat_template": own}
    engine = make_engine(ckpt, device="cpu")
    with ServerThread(engine) as s:
        r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and "--trust-request-chat-template" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "chat_template"
    engine = make_engine(ckpt, device="cpu")
    with ServerThread(engine, trust_request_chat_template=True) as s:
        want = engine.tokenizer.encode("hi there =>", add_special_tokens=False)
        r = httpx.post(s.base_url + "/tokenize", json={"messages": MESSAGES, "chat_template": own}, timeout=30)
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        r = httpx.post(s.base_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
        # text only: a path is not read (rendered as the literal text it is), a syntax error is a 400
        r = httpx.post(s.base_url + "/v1/chat/completions", json={**body, "chat_template": "{% if %}"}, timeout=60)
        assert r.status_code == 400 and "not a valid Jinja template" in r.json()["error"]["message"], r.text
        r = httpx.post(s.base_url + "/tokenize", json={"messages": MESSAGES, "chat_template": "/etc/hostname"},
                       timeout=30)
        assert r.json()["tokens"] == engine.tokenizer.encode("/etc/hostname", add_special_tokens=False), r.text
        # the server's own template is unchanged for the next request
        r = httpx.post(s.base_url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
        assert r.json()["tokens"] == engine.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                          tokenize=True, return_dict=False)


def test_llm_chat_refuses_template_kwargs_that_set_its_own_arguments(ckpt):
    from pagedmoe import LLM, SamplingParams

    llm = LLM(str(ckpt), device="cpu", max_model_len=96)
    with pytest.raises(ValueError, match=r"chat_template_kwargs may not set \['tokenize'\]"):
        llm.chat(MESSAGES, SamplingParams(max_tokens=1), use_tqdm=False, chat_template_kwargs={"tokenize": False})
