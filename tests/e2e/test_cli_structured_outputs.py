"""`pagedmoe generate` (and `chat`) constraint flags, llama.cpp's names: --json-schema / --json-schema-file,
--json-object, --regex, --choice, --grammar / --grammar-file. On a tiny random checkpoint every output that parses
is the constraint at work, on every prompt; at most one flag (argparse refuses two); a bad file, schema, regex or
grammar, or llguidance missing, is one line (exit 2) before the model loads."""
from __future__ import annotations

import io
import json
import re
import sys

import pytest

pytest.importorskip("llguidance")

from pagedmoe.cli import main  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

PROMPTS = ["hello", "def add(a, b):", "print"]
# no whitespace inside the JSON (llguidance's own option, in the schema): a random model would write whitespace
# until --max-tokens
SCHEMA = {"x-guidance": {"whitespace_flexible": False}, "type": "object",
          "properties": {"name": {"type": "string", "enum": ["ann", "bob", "cy"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
GBNF = 'root ::= "[" item ("," item)* "]"\nitem ::= "a" | "bb" | "ccc"\n'


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3_moe_cli_so")
    make_tiny_checkpoint("qwen3_moe", path, seed=4)
    return str(path)


def _generate(ckpt, tmp_path, *flags, max_tokens=60):
    out = tmp_path / "out.json"
    argv = ["--log-level", "WARNING", "generate", ckpt, "--device", "cpu", "--max-model-len", "128",
            "--max-tokens", str(max_tokens), "--temperature", "1", "--sampling-seed", "7", "--output-json", str(out)]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main([*argv, *flags]) == 0
    rows = json.loads(out.read_text())
    assert [r["prompt"] for r in rows] == PROMPTS
    return rows


def _texts(rows):
    assert all(r["finish_reason"] == "stop" for r in rows), rows
    return [r["text"] for r in rows]


def test_regex(ckpt, tmp_path):
    for text in _texts(_generate(ckpt, tmp_path, "--regex", r"[a-c]{2,5}-[0-9]{3}")):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", text), text


def test_json_schema_inline_and_from_a_file(ckpt, tmp_path):
    texts = _texts(_generate(ckpt, tmp_path, "--json-schema", json.dumps(SCHEMA)))
    for text in texts:
        obj = json.loads(text)   # SCHEMA by hand
        assert isinstance(obj, dict) and set(obj) == {"name", "age", "ok"}, text
        assert obj["name"] in ("ann", "bob", "cy") and isinstance(obj["ok"], bool)
        assert type(obj["age"]) is int and 0 <= obj["age"] <= 120
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA, indent=2))
    assert _texts(_generate(ckpt, tmp_path, "--json-schema-file", str(path))) == texts  # the same constraint


def test_choice_after_one_flag_or_repeated(ckpt, tmp_path):
    choices = ["yes", "no", "maybe later"]
    texts = _texts(_generate(ckpt, tmp_path, "--choice", "yes", "no", "--choice", "maybe later"))
    assert all(t in choices for t in texts), texts


def test_grammar_file_gbnf(ckpt, tmp_path):
    path = tmp_path / "list.gbnf"
    path.write_text(GBNF)
    for text in _texts(_generate(ckpt, tmp_path, "--grammar-file", str(path), max_tokens=40)):
        assert re.fullmatch(r"\[(a|bb|ccc)(,(a|bb|ccc))*\]", text), text
    lark = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,3}/'
    for text in _texts(_generate(ckpt, tmp_path, "--grammar", lark, max_tokens=40)):
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})*\)", text), text


def test_chat_constrains_every_reply(ckpt, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\nand again?\n\n"))
    assert main(["--log-level", "WARNING", "chat", ckpt, "--device", "cpu", "--max-model-len", "128",
                 "--temperature", "1", "--sampling-seed", "3", "--choice", "yes", "no", "maybe later"]) == 0
    out = capsys.readouterr().out
    replies = [line.removeprefix("> ") for line in out.split("\n")[:-1]]   # input()'s "> ", the reply, a newline
    assert len(replies) == 2 and all(r in ("yes", "no", "maybe later") for r in replies), out


@pytest.mark.parametrize("flags", [["--regex", "a", "--choice", "b"], ["--json-object", "--grammar", "root ::= \"a\""],
                                   ["--json-schema", "{}", "--json-schema-file", "s.json"]], ids=lambda f: f[0])
def test_two_constraints_are_refused(flags, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "x", *flags])
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err.strip().splitlines()[-1]


def _bad_files(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "latin1.gbnf").write_bytes(b'root ::= "\xe9"\n')
    (tmp_path / "empty.lark").write_text(" \n")
    (tmp_path / "bad.json").write_text('{"type": "object",}')
    (tmp_path / "schema.json").write_text("{}")


@pytest.mark.parametrize("flags, expected", [
    (["--grammar-file", "{d}/missing.gbnf"], "--grammar-file {d}/missing.gbnf does not exist"),
    (["--grammar-file", "{d}/folder"], "--grammar-file {d}/folder is not a file"),
    (["--grammar-file", "{d}/latin1.gbnf"], "--grammar-file {d}/latin1.gbnf is not UTF-8 text (byte 10"),
    (["--grammar-file", "{d}/empty.lark"], "--grammar-file {d}/empty.lark is empty"),
    (["--json-schema-file", "{d}/bad.json"], "--json-schema-file {d}/bad.json is not valid JSON (Expecting"),
    (["--json-schema-file", "{d}/missing.json"], "--json-schema-file {d}/missing.json does not exist"),
    (["--json-schema", '{"type": '], "--json-schema is not valid JSON (Expecting value"),
    (["--json-schema", "{d}/schema.json"], "; {d}/schema.json is a file: pass --json-schema-file {d}/schema.json"),
    (["--json-schema", "[1, 2]"], "--json-schema: a JSON schema is an object, got list"),
    (["--json-schema", '{"type": "objekt"}'], "--json-schema: invalid JSON schema: "),
    (["--regex", "(a"], "--regex: invalid regex: "),
    (["--regex", ""], "--regex must be a non-empty string"),
    (["--grammar", "root ::= foo"], "--grammar: "),
    (["--grammar", "start: missing_rule"], "--grammar: "),
    (["--grammar-file", "{d}/bad.json"], "--grammar-file {d}/bad.json: "),
])
def test_bad_constraint_is_one_line_before_loading(tmp_path, capsys, flags, expected):
    """The model path does not exist: had the model been loaded first, that would be the error."""
    _bad_files(tmp_path)
    d = str(tmp_path)
    argv = ["generate", str(tmp_path / "no-model"), "--device", "cpu", "--prompt", "x"]
    assert main([*argv, *[f.replace("{d}", d) for f in flags]]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("pagedmoe generate: error: ") and expected.replace("{d}", d) in err, err


@pytest.mark.parametrize("verb", ["generate", "chat"])
def test_without_llguidance_a_constraint_is_one_line(tmp_path, monkeypatch, capsys, verb):
    for name in [m for m in sys.modules if m == "llguidance" or m.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)   # import llguidance now fails
    extra = ["--prompt", "x"] if verb == "generate" else []
    assert main([verb, str(tmp_path / "no-model"), "--device", "cpu", *extra, "--regex", "[a-z]+"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"pagedmoe {verb}: error: structured outputs need the llguidance package[^\n]*"
                        r"pip install llguidance[^\n]*", err), err
