"""`pagedmoe bench {throughput,latency,serve,sweep}`: each sub-verb module exposes register(bench_sub)."""
from __future__ import annotations

import importlib

BENCH_MODULES = [
    "pagedmoe.bench.throughput",
    "pagedmoe.bench.latency",
    "pagedmoe.bench.serve",
    "pagedmoe.bench.sweep",
]


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, sweep",
                       description="Benchmarks with vLLM's output formats.")
    bench_sub = p.add_subparsers(dest="bench_verb", metavar="{bench}")
    for name in BENCH_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue  # not part of this build yet
            raise
        module.register(bench_sub)
    p.set_defaults(func=lambda args: p.print_help() or 2)
