"""`pagedmoe generate` (one-shot prompts) and `pagedmoe chat` (interactive, chat template)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pagedmoe.config import add_engine_args, engine_config_from_args


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed (reproducible)")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args):
    from pagedmoe.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, seed=args.sampling_seed, stop=args.stop,
                          ignore_eos=args.ignore_eos, logprobs=args.logprobs)


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

    c = sub.add_parser("chat", help="chat interactively (the model's chat template)")
    c.add_argument("model", nargs="?", default=None)
    c.add_argument("--system", default=None, help="system message")
    add_sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=run_chat)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        if not args.prompts_file.is_file():
            raise FileNotFoundError(f"prompts file {args.prompts_file} does not exist")
        for line_no, line in enumerate(args.prompts_file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if args.prompts_file.suffix == ".jsonl":
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{args.prompts_file}:{line_no}: expected {{\"prompt\": ...}} ({e})")
            else:
                prompts.append(line.replace("\\n", "\n"))
    if not prompts:
        raise ValueError("no prompts: pass --prompt TEXT or --prompts-file FILE")
    return prompts


def run_generate(args) -> int:
    from pagedmoe.llm import LLM, GenerationError

    prompts = _read_prompts(args)
    params = sampling_params_from_args(args)
    config = engine_config_from_args(args, model=args.model)
    llm = LLM(**vars(config))
    try:
        outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    except GenerationError as e:  # print what did finish, then the one-line error (cli.py)
        _print_outputs([o for o in e.outputs if o.error is None], args.output_json)
        raise
    _print_outputs(outputs, args.output_json)
    return 0


def _print_outputs(outputs, output_json) -> None:
    for out in outputs:
        print(f"--- prompt: {out.prompt!r}")
        print(out.prompt + out.outputs[0].text if out.prompt else out.outputs[0].text)
        print(f"--- ({len(out.outputs[0].token_ids)} tokens, finish_reason={out.outputs[0].finish_reason})")
    if output_json:
        output_json.write_text(json.dumps([
            {"prompt": o.prompt, "text": o.outputs[0].text, "token_ids": o.outputs[0].token_ids,
             "finish_reason": o.outputs[0].finish_reason} for o in outputs], indent=2))


def run_chat(args) -> int:
    from pagedmoe.llm import LLM, GenerationError

    params = sampling_params_from_args(args)
    llm = LLM(**vars(engine_config_from_args(args, model=args.model)))
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        try:
            reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        except GenerationError as e:  # out of memory in its step: say so, forget the turn, chat on
            print(f"chat: error: {e}", file=sys.stderr)
            history.pop()
            continue
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0
