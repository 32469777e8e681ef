"""What the deployment tests share: a command line through the real ``cortex`` parser, as
the container would run it, with a record of the environment variables the service read."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cortex.edge.main import build_parser

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def image_commands(install_script: ModuleType) -> Callable[[str], frozenset[str]]:
    """``image_commands(image)``: the ``cortex`` subcommands a docker/Dockerfile target
    offers (its distribution's and its libraries' ``cortex.commands`` entry points)."""
    return functools.cache(lambda image: frozenset(install_script.image_commands(REPO, image)))


class RecordingEnviron(dict[str, str]):
    """``os.environ`` stand-in that remembers every key looked up (a typo'd variable a
    service never reads is then visible)."""

    def __init__(self, values: Mapping[str, str]) -> None:
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self.read.add(key)
        return super().__contains__(key)


class ParseCortex:
    """``parse_cortex(where, command, env)``: ``cortex <command>`` parsed by the real parser
    with exactly ``env`` as the process's ``CORTEX_*`` environment (some parsers take
    defaults from it when they are built); a command line argparse rejects fails the test,
    naming ``where``. Until the next call, ``os.environ`` is a :class:`RecordingEnviron`
    (:attr:`environ`): build the service's config from it to learn what it reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self._monkeypatch = monkeypatch
        self.environ = RecordingEnviron({})

    def __call__(self, where: str, command: Sequence[str],
                 env: Mapping[str, str]) -> argparse.Namespace:
        base = {k: v for k, v in os.environ.items() if not k.startswith("CORTEX_")}
        self.environ = RecordingEnviron({**base, **env})
        self._monkeypatch.setattr(os, "environ", self.environ)
        argv = [str(part) for part in command]
        try:
            return build_parser(argv).parse_args(argv)
        except SystemExit as exc:  # argparse's way to reject a command line
            raise AssertionError(f"{where}: `cortex {' '.join(argv)}` does not parse") from exc

    def start(self, args: argparse.Namespace) -> Any:
        """Run the parsed command's real entry point up to where it would serve: its
        ``_serve`` coroutine is replaced by one that keeps the config it was handed (the
        service's validated config; an entry point that refuses it fails the test)."""
        module = sys.modules[args.func.__module__]
        handed: list[Any] = []

        async def serve(config: Any, *_more: Any) -> None:
            handed.append(config)

        self._monkeypatch.setattr(module, "_serve", serve)
        code = args.func(args)
        assert code == 0 and handed, f"{module.__name__} exited {code} before serving"
        return handed[0]

    def unread(self, env: Mapping[str, str]) -> list[str]:
        """The ``CORTEX_*`` variables of ``env`` nothing has looked up since the last call."""
        return sorted(k for k in env if k.startswith("CORTEX_") and k not in self.environ.read)


@pytest.fixture
def parse_cortex(monkeypatch: pytest.MonkeyPatch) -> ParseCortex:
    return ParseCortex(monkeypatch)
