"""What the deployment tests share: a command line through the real ``cortex`` parser, as
the container would run it."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence

import pytest

from cortex.cli.main import build_parser

ParseCortex = Callable[[str, Sequence[str], Mapping[str, str]], argparse.Namespace]


@pytest.fixture
def parse_cortex(monkeypatch: pytest.MonkeyPatch) -> ParseCortex:
    """``parse_cortex(where, command, env)``: ``cortex <command>`` parsed by the real parser
    with exactly ``env`` as the process's ``CORTEX_*`` environment (some parsers take
    defaults from the environment when they are built); a command line argparse rejects
    fails the test, naming ``where``."""

    def parse(where: str, command: Sequence[str], env: Mapping[str, str]) -> argparse.Namespace:
        for key in [k for k in os.environ if k.startswith("CORTEX_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        argv = [str(part) for part in command]
        try:
            return build_parser(argv).parse_args(argv)
        except SystemExit as exc:  # argparse's way to reject a command line
            raise AssertionError(f"{where}: `cortex {' '.join(argv)}` does not parse") from exc

    return parse
