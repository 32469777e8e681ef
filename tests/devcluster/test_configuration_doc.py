"""docs/configuration.md names every setting the services accept (read from the code)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest

from cortex.edge.main import build_parser
from cortex.gateway.config.gateway import ENV_PREFIX, GatewayConfig

DOC = (Path(__file__).resolve().parents[2] / "docs/configuration.md").read_text()


def gateway_settings(cls: type[object] = GatewayConfig, prefix: str = ""
                     ) -> Iterator[tuple[str, str]]:
    """``(dotted setting, environment variable)`` of every gateway config field."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not field.init:  # derived on creation (as cortex.edge.settings skips them too)
            continue
        kind = hints[field.name]
        dotted = f"{prefix}{field.name}"
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            yield from gateway_settings(kind, dotted + ".")
            continue
        yield dotted, ENV_PREFIX + dotted.replace(".", "_").upper()


def flags(*command: str) -> list[str]:
    parser = build_parser(list(command))
    for name in command:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return [option for action in parser._actions for option in action.option_strings
            if option.startswith("--") and option != "--help"]


def test_every_gateway_setting_and_variable_is_documented() -> None:
    settings = list(gateway_settings())
    assert len(settings) > 40
    missing = [s for s, env in settings if f"`{s}`" not in DOC or (
        s != "routing.watermarks" and f"`{env}`" not in DOC)]
    assert missing == []


@pytest.mark.parametrize("command", [("index",), ("ingest", "run"), ("up",), ("serve",),
                                     ("workers", "add"), ("discover-pods",), ("gateway",)])
def test_every_flag_is_documented(command: tuple[str, ...]) -> None:
    options = flags(*command)
    assert options
    assert [o for o in options if f"`{o}`" not in DOC] == []
