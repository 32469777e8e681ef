"""The umbrella ``cortex`` command: one program, one subcommand per concern.

Each subcommand lives beside the code it drives, in a module that exposes
``register(subparsers)``. The module adds its own parser and sets ``func`` to a
callable taking the parsed arguments and returning the process exit code.
Modules are imported lazily so ``cortex hash`` does not pay for the gateway's
imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from typing import Any

# subcommand name -> module that registers it
SUBCOMMANDS: dict[str, str] = {
    "hash": "cortex.hashing.cli",
    "events": "cortex.ingest.cli_events",
    "sim": "cortex.sim.cli",
    "index": "cortex.index.cli",
    "ingest": "cortex.ingest.cli",
    "workers": "cortex.ingest.cli_workers",
    "discover-pods": "cortex.registry.kubernetes.cli",
    "gateway": "cortex.gateway.cli",
    "up": "cortex.cli.up",
    "serve": "cortex.cli.serve",
    "bench": "cortex.bench.cli",
}


def register_subcommands(sub: argparse._SubParsersAction[Any], modules: Mapping[str, str],
                         wanted: str | None = None) -> None:
    """Call each module's ``register(sub)``; a module absent from this build becomes a stub
    parser saying so instead of breaking the others. With ``wanted``, only that subcommand's
    module is imported (the others get stubs pointing at their own ``--help``)."""
    for name, module_name in modules.items():
        if wanted is not None and name != wanted:
            sub.add_parser(name, help=f"(see cortex {name} --help)")
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:
                raise
            sub.add_parser(name, help="(not available in this build)")
            continue
        module.register(sub)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cortex", description="KV-cache-aware inference gateway")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    register_subcommands(sub, SUBCOMMANDS, next((a for a in argv if not a.startswith("-")), None))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    func = getattr(args, "func", None)
    if func is None:
        parser.error(f"'{args.command}' is not available in this build")
    code: int = func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
