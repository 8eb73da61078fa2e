"""`pagedmoe <verb>`: each verb lives in its own module, which exposes register(subparsers).

A verb's handler is stored with `parser.set_defaults(func=handler)` and returns an exit code.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# verb -> module with register(subparsers). Modules are imported only when present, so a verb
# appears in --help exactly when it exists.
VERB_MODULES = [
    "pagedmoe.entrypoints.generate",   # generate, chat
    "pagedmoe.server.cli",             # serve
    "pagedmoe.bench.cli",              # bench throughput|latency|serve|sweep
    "pagedmoe.entrypoints.plan",       # plan
    "pagedmoe.entrypoints.compress",   # compress, decompress
    "pagedmoe.entrypoints.eval",       # eval
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedmoe",
        description="Serve Mixture-of-Experts LLMs on memory-short GPUs. Every engine flag can also be "
                    "set as PAGEDMOE_<FLAG_NAME> in the environment (flags win).")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    register_modules(parser.add_subparsers(dest="verb", metavar="{verb}"), VERB_MODULES)
    return parser


def register_modules(subparsers, module_names: list[str]) -> None:
    """Let each module add its verb(s); a module that is not part of this build is skipped."""
    for name in module_names:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue
            raise
        module.register(subparsers)


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C (chat, generate, a long load): quiet, with the shell's status for SIGINT
        print(file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    from pagedmoe.config import EnvVarError

    try:
        parser = build_parser()  # reads the PAGEDMOE_* defaults, so a bad one stops even --help
    except EnvVarError as e:
        print(f"pagedmoe: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.version:
        from pagedmoe import __version__

        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    from pagedmoe.extras import MissingPackageError

    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, MissingPackageError) as e:
        # Bad input: one clear line, no traceback.
        print(f"pagedmoe {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - only the kinds below; anything else keeps its traceback
        if not _is_oom(e):
            raise
        # Out of device memory (pagedmoe/oom.py names what and the budget; torch's message is one line too).
        print(f"pagedmoe {args.verb}: error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


def _is_oom(e: BaseException) -> bool:
    """torch's OOM (pagedmoe's named one is a subclass), or generate() requests that failed of one; without
    importing torch for verbs that never loaded it."""
    if "torch" not in sys.modules:
        return False
    import torch

    from pagedmoe.llm import GenerationError

    return isinstance(e, (torch.OutOfMemoryError, GenerationError))


if __name__ == "__main__":
    sys.exit(main())
