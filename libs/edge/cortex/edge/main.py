"""The umbrella ``cortex`` command: one program, one subcommand per concern.

Each distribution names the subcommands it brings in its ``cortex.commands`` entry points
(``gateway = "cortex.gateway.cli"``), so an image holding one service offers that service's
commands and says of the others that they are not in this build. A command's module exposes
``register(subparsers)``: it adds its own parser and sets ``func`` to a callable taking the
parsed arguments and returning the process exit code. Modules are imported lazily so
``cortex hash`` does not pay for the gateway's imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Mapping, Sequence
from importlib.metadata import entry_points
from typing import Any

__all__ = ["build_parser", "installed_commands", "main", "register_subcommands"]

GROUP = "cortex.commands"


def installed_commands() -> dict[str, str]:
    """Subcommand name -> the module that registers it, from every installed distribution."""
    return {ep.name: ep.value for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name)}


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
    wanted = next((a for a in argv if not a.startswith("-")), None)
    register_subcommands(sub, installed_commands(), wanted)
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
