"""Command-line glue shared by the micro-benchmarks that time cases for ``--seconds``
each and write one markdown report into ``--out``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_timed_parser", "timed_main"]

RunReport = Callable[[Path, float], Path]
"""``run(out_dir, seconds_per_case) -> report path``."""


def _arguments(
    parser: argparse.ArgumentParser, name: str, run: RunReport, default_seconds: float
) -> None:
    parser.add_argument(
        "--out", default="docs/bench", metavar="DIR", help="report directory (default docs/bench)"
    )
    parser.add_argument(
        "--seconds", type=float, default=default_seconds, metavar="S",
        help=f"measuring time per case (default {default_seconds})",
    )

    def run_cli(args: argparse.Namespace) -> int:
        if not args.seconds > 0:
            print(f"cortex bench {name}: error: --seconds must be positive", file=sys.stderr)
            return 2
        print(run(Path(args.out), args.seconds))
        return 0

    parser.set_defaults(func=run_cli)


def add_timed_parser(
    bench_subparsers: argparse._SubParsersAction[Any],
    name: str,
    run: RunReport,
    default_seconds: float,
    *,
    help: str,
    description: str,
) -> None:
    """Add ``cortex bench NAME [--out DIR] [--seconds S]``."""
    parser = bench_subparsers.add_parser(name, help=help, description=description)
    _arguments(parser, name, run, default_seconds)


def timed_main(
    name: str, run: RunReport, default_seconds: float, argv: Sequence[str] | None
) -> int:
    """``python -m cortex.bench.NAME``: the same options without the ``cortex`` program."""
    parser = argparse.ArgumentParser(prog=f"python -m cortex.bench.{name}")
    _arguments(parser, name, run, default_seconds)
    args = parser.parse_args(argv)
    code: int = args.func(args)
    return code
