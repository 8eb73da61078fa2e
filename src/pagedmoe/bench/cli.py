"""`pagedmoe bench {throughput,latency,serve,sweep}`: each sub-verb module exposes register(bench_sub)."""
from __future__ import annotations

BENCH_MODULES = [
    "pagedmoe.bench.throughput",
    "pagedmoe.bench.latency",
    "pagedmoe.bench.serve",
    "pagedmoe.bench.sweep",
]


def register(sub) -> None:
    from pagedmoe.cli import register_modules

    p = sub.add_parser("bench", help="benchmarks: throughput, latency, serve, sweep",
                       description="Benchmarks with vLLM's output formats.")
    register_modules(p.add_subparsers(dest="bench_verb", metavar="{bench}"), BENCH_MODULES)
    p.set_defaults(func=lambda args: p.print_help() or 2)
