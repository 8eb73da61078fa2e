"""`pagedmoe generate` (one-shot prompts) and `pagedmoe chat` (interactive, chat template); both stream
their output (entrypoints/streaming.py) and end with prompt and generation rates on stderr. Both take the sampling
flags and one structured-outputs constraint (--json-schema, --regex, --choice, --grammar-file, ...) for every output."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from pagedmoe.config import add_engine_args, engine_config_from_args
from pagedmoe.engine.limits import context_length_error, jsonl_strings, lone_surrogate, read_utf8


# The sampling flags the model's generation_config.json gives defaults for (generation_config.py), and the flags' own
# defaults where it gives none (--max-tokens: the verb's, add_sampling_args).
SAMPLING_FLAG_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: Optional[int] = 64) -> None:
    g = parser.add_argument_group(
        "sampling", "a flag left out takes the model's default from its generation_config.json (temperature, top_p, "
                    "top_k, min_p, repetition_penalty, max_new_tokens; --generation-config vllm: none), else the "
                    "default shown")
    g.add_argument("--max-tokens", type=int, default=None,
                   help="most new tokens per reply (default: " + (f"{max_tokens})" if max_tokens else
                                                                 "until the model stops or the context is full)"))
    parser.set_defaults(verb_max_tokens=max_tokens)
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=None, help="(default: 1)")
    g.add_argument("--top-k", type=int, default=None, help="0 or -1 = off (default: -1)")
    g.add_argument("--min-p", type=float, default=None, help="(default: 0)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=None, help="(default: 1)")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None,
                   help="print the N most likely tokens and their logprobs after each output (and in --output-json)")
    add_constraint_args(parser)


def add_constraint_args(parser: argparse.ArgumentParser) -> None:
    """Structured outputs from the command line, llama.cpp's flag names where it has them (--json-schema,
    --json-schema-file, --grammar, --grammar-file): at most one, applied to every prompt (every reply in chat).
    A flag's value is its text inline; a file comes with the -file flag. Like the other sampling flags, no
    PAGEDMOE_* environment variables (those are for engine flags)."""
    g = parser.add_argument_group(
        "structured outputs", "constrain every output (at most one of these; needs llguidance: pip install llguidance)")
    m = g.add_mutually_exclusive_group()
    m.add_argument("--json-schema", metavar="SCHEMA",
                   help="the output is JSON valid against this JSON schema, given as its JSON text (a file: "
                        "--json-schema-file)")
    m.add_argument("--json-schema-file", type=Path, metavar="FILE", help="--json-schema read from FILE")
    m.add_argument("--json-object", action="store_true", help="the output is a JSON object (any)")
    m.add_argument("--regex", metavar="REGEX",
                   help="the whole output matches this regular expression (Rust regex syntax, as llguidance reads it)")
    m.add_argument("--choice", nargs="+", action="extend", default=None, metavar="TEXT",
                   help="the output is exactly one of these strings (several after one --choice, or --choice "
                        "repeated; put MODEL before it)")
    m.add_argument("--grammar", metavar="GRAMMAR",
                   help="the output is in this grammar's language: Lark (llguidance's dialect, start rule `start`) "
                        "or GBNF (llama.cpp's, start rule `root`)")
    m.add_argument("--grammar-file", type=Path, metavar="FILE", help="--grammar read from FILE (.lark or .gbnf)")


def _read_constraint_file(flag: str, path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {path} {'is not a file' if path.exists() else 'does not exist'}")
    try:
        text = read_utf8(path, f"{flag}")
    except OSError as e:  # unreadable (permissions, ...)
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None
    if not text.strip():
        raise ValueError(f"{flag} {path} is empty")
    return text


def _parse_schema(flag: str, text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        hint = ""
        if flag == "--json-schema" and len(text) < 4096 and Path(text).is_file():
            hint = f"; {text} is a file: pass --json-schema-file {text}"
        raise ValueError(f"{where} is not valid JSON ({e}){hint}") from None
    except RecursionError:
        raise ValueError(f"{where}: the JSON schema is nested too deeply") from None


def structured_outputs_from_args(args):
    """StructuredOutputsParams from the constraint flags (None without one), compiled here, so a bad schema, regex
    or grammar, or llguidance missing, is a one-line ValueError naming the flag before the model loads."""
    from pagedmoe.structured_outputs import StructuredOutputsParams

    if getattr(args, "json_schema", None) is not None:
        flag, kw = "--json-schema", {"json": _parse_schema("--json-schema", args.json_schema, "--json-schema")}
    elif getattr(args, "json_schema_file", None) is not None:
        flag, path = "--json-schema-file", args.json_schema_file
        kw = {"json": _parse_schema(flag, _read_constraint_file(flag, path), f"{flag} {path}")}
    elif getattr(args, "json_object", False):
        flag, kw = "--json-object", {"json_object": True}
    elif getattr(args, "regex", None) is not None:
        flag, kw = "--regex", {"regex": args.regex}
    elif getattr(args, "choice", None) is not None:
        flag, kw = "--choice", {"choice": list(args.choice)}
    elif getattr(args, "grammar", None) is not None:
        flag, kw = "--grammar", {"grammar": args.grammar}
    elif getattr(args, "grammar_file", None) is not None:
        flag = "--grammar-file"
        kw = {"grammar": _read_constraint_file(flag, args.grammar_file)}
        flag = f"{flag} {args.grammar_file}"
    else:
        return None
    if "json" in kw and not isinstance(kw["json"], (dict, bool)):
        raise ValueError(f"{flag}: a JSON schema is an object, got {type(kw['json']).__name__}")
    try:
        so = StructuredOutputsParams(**kw)
        so.compiled()  # what SamplingParams checks; made once (kept on the parameters)
    except ValueError as e:
        message = str(e)
        kind = next(iter(kw))
        for prefix in (f"structured_outputs.{kind}: ", f"structured_outputs.{kind} "):
            if message.startswith(prefix):  # "structured_outputs.regex: invalid regex: ..." -> "--regex: invalid ..."
                message = f"{flag}{prefix[len('structured_outputs.') + len(kind):]}{message[len(prefix):]}"
                break
        raise ValueError(message) from None
    return so


def sampling_params_from_args(args, config):
    """The flags' SamplingParams: a flag left out takes the model's default (config: the engine's, whose
    --generation-config / --override-generation-config are read here too, so a bad one fails before the load)."""
    from pagedmoe.config import resolve_model
    from pagedmoe.generation_config import sampling_defaults
    from pagedmoe.sampling_params import SamplingParams

    model, _ = sampling_defaults(config.generation_config, config.override_generation_config,
                                 resolve_model(config.model))
    given = {name: getattr(args, name) for name in (*SAMPLING_FLAG_DEFAULTS, "max_tokens")}
    fallback = {**SAMPLING_FLAG_DEFAULTS, "max_tokens": args.verb_max_tokens}
    picked = {name: value if value is not None else model.get(name, fallback[name]) for name, value in given.items()}
    return SamplingParams(**picked, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
                          logprobs=args.logprobs, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty,
                          structured_outputs=structured_outputs_from_args(args))


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for prompts", description="Generate text offline.")
    p.add_argument("model", nargs="?", default=None, help="checkpoint folder (default: the embedded model)")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", type=Path, default=None,
                   help="a file with one prompt per line, or a .jsonl of {\"prompt\": ...}")
    p.add_argument("--output-json", type=Path, default=None, help="write the outputs as JSON here")
    add_sampling_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_generate)

    c = sub.add_parser("chat", help="chat interactively (the model's chat template)",
                       description="Chat with line editing and history (readline). Replies stream as they are "
                                   "generated; the oldest turns are dropped (and you are told) when the "
                                   "conversation outgrows the context.")
    c.add_argument("model", nargs="?", default=None)
    c.add_argument("--system", default=None, help="system message")
    add_sampling_args(c, max_tokens=None)
    add_engine_args(c)
    c.set_defaults(func=run_chat)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            what = "is not a file" if args.prompts_file.exists() else "does not exist"
            raise FileNotFoundError(f"prompts file {args.prompts_file} {what}")
        text = read_utf8(args.prompts_file, "prompts file")
        if args.prompts_file.suffix == ".jsonl":
            prompts += jsonl_strings(args.prompts_file, text, "prompt", '{"prompt": ...}', '"prompt"')
        else:
            prompts += [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT or --prompts-file FILE")
    for p in prompts:
        if lone_surrogate(p) is not None:
            raise ValueError(f"prompt {p[:60]!r} is not UTF-8 text")
    return prompts


def _check_fits(limit: int, num_prompt: int, max_tokens: Optional[int]) -> None:
    err = context_length_error(limit, num_prompt, max_tokens)
    if err is not None:
        raise ValueError(err[0])  # the server's 400, word for word


def run_generate(args) -> int:
    from pagedmoe.entrypoints.streaming import format_logprobs, logprobs_json, stream
    from pagedmoe.llm import LLM, check_failed

    prompts = _read_prompts(args)
    config = engine_config_from_args(args, model=args.model)
    params = sampling_params_from_args(args, config)
    llm = LLM(**vars(config))
    engine = llm.engine
    if engine.tokenizer is None:
        raise ValueError("this model has no tokenizer: generate takes text prompts")
    encoded = [(p, engine.tokenizer.encode(p)) for p in prompts]
    for _, ids in encoded:
        _check_fits(engine.max_model_len, len(ids), params.max_tokens)

    def before(i: int) -> None:
        print(f"--- prompt: {prompts[i]!r}")
        print(prompts[i], end="", flush=True)

    def after(i: int, out) -> None:
        c = out.outputs[0]
        print(f"\n--- ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
        if params.logprobs is not None:
            print(format_logprobs(out, params.logprobs))

    outputs, rates = stream(engine, encoded, params, sys.stdout, before, after)
    print(rates.line(), file=sys.stderr)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)  # as bench and plan do
        args.output_json.write_text(json.dumps([
            {"prompt": prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
             "finish_reason": o.outputs[0].finish_reason,
             **({"logprobs": logprobs_json(o, params.logprobs), "cumulative_logprob": o.outputs[0].cumulative_logprob}
                if params.logprobs is not None else {})} for prompt, o in zip(prompts, outputs)], indent=2))
    check_failed(outputs, outputs)  # what finished is printed; then the one-line error (cli.py)
    return 0


def fit_conversation(tokenizer, history: list[dict], limit: int, reserve: int) -> tuple[Optional[list[int]], int]:
    """The prompt ids of the conversation, its oldest turns dropped (a system message stays) until the
    prompt leaves `reserve` tokens of the `limit`-token context. Returns (ids or None if even the last
    message alone does not fit, number of messages dropped); drops them from `history` in place."""
    dropped = 0
    while True:
        ids = list(tokenizer.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
        if len(ids) + reserve <= limit:
            return ids, dropped
        first = 1 if history and history[0]["role"] == "system" else 0
        if len(history) - first <= 1:
            return None, dropped
        del history[first]
        dropped += 1


def run_chat(args) -> int:
    from pagedmoe.entrypoints.streaming import format_logprobs, stream
    from pagedmoe.llm import LLM

    if sys.stdin.isatty():
        import readline  # noqa: F401 - input() then edits lines and keeps a history (Up / Down)
    if hasattr(sys.stdin, "reconfigure"):  # whatever the locale, a line that is not UTF-8 is refused, not fatal
        sys.stdin.reconfigure(errors="surrogateescape")
    config = engine_config_from_args(args, model=args.model)
    params = sampling_params_from_args(args, config)
    llm = LLM(**vars(config))
    engine, tok = llm.engine, llm.get_tokenizer()
    if tok is None or not getattr(tok, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use `pagedmoe generate`")
    limit = engine.max_model_len
    history = [{"role": "system", "content": args.system}] if args.system else []
    system_ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True,
                                         return_dict=False) if history else [0]
    _check_fits(limit, len(system_ids), params.max_tokens)  # even a first message could never fit
    # room kept for the reply: --max-tokens, else a quarter of the context (at most 512 tokens)
    reserve = params.max_tokens if params.max_tokens is not None else min(512, max(1, limit // 4))
    print(f"chat: {limit}-token context; empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        if lone_surrogate(line) is not None:
            print("[this message is not UTF-8 text; not sent]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        ids, dropped = fit_conversation(tok, history, limit, reserve)
        if dropped:
            print(f"[context: dropped the {dropped} oldest message(s) to stay within {limit} tokens]",
                  file=sys.stderr)
        if ids is None:
            print(f"[this message does not fit the {limit}-token context with {reserve} tokens left for the "
                  f"reply; not sent]", file=sys.stderr)
            history.pop()
            continue
        (out,), rates = stream(engine, [(None, ids)], params, sys.stdout)
        c = out.outputs[0]
        print()
        if out.error is not None:  # out of memory in its step: say so, forget the turn, chat on
            print(f"chat: error: {out.error}", file=sys.stderr)
            history.pop()
            continue
        if c.finish_reason == "length":
            why = ("the context is full" if params.max_tokens is None or len(c.token_ids) < params.max_tokens
                   else "--max-tokens" if args.max_tokens is not None else "the model's max_new_tokens")
            print(f"[reply cut at {len(c.token_ids)} tokens: {why}]", file=sys.stderr)
        if params.logprobs is not None:
            print(format_logprobs(out, params.logprobs))
        print(rates.line(), file=sys.stderr)
        history.append({"role": "assistant", "content": c.text})
    return 0
