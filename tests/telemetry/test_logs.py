"""One logging setup for every service: the same flags, the same JSON fields."""

from __future__ import annotations

import argparse
import io
import json
import logging
from collections.abc import Iterator

import pytest

from cortex.edge.main import build_parser
from cortex.telemetry import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_the_basics_and_every_structured_field(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("info", "json", out)
    log = logging.getLogger("cortex.ingest.somewhere")
    log.debug("not at info")
    log.info("worker %s caught up", "w1", extra={"worker": "w1", "request_id": None,
                                                  "lag_ms": 3.5})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed", extra={"mode": "exact_kv"})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert set(first) == {"ts", "level", "logger", "msg", "worker", "lag_ms"}
    assert (first["level"], first["logger"], first["msg"]) == (
        "info", "cortex.ingest.somewhere", "worker w1 caught up")
    assert first["worker"] == "w1" and first["lag_ms"] == 3.5
    assert second["mode"] == "exact_kv" and "ValueError: boom" in second["exc"]


def test_text_lines_and_bad_formats(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging("warning", "text", out)
    logging.getLogger("cortex.index").info("hidden")
    logging.getLogger("cortex.index").warning("shown")
    assert out.getvalue().rstrip().endswith("WARNING cortex.index: shown")
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")


@pytest.mark.parametrize("command", [("gateway",), ("index",), ("ingest", "run")])
def test_every_service_takes_the_same_logging_flags(command: tuple[str, ...]) -> None:
    parser = build_parser(list(command))
    for name in command:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    options = {o: a for a in parser._actions for o in a.option_strings}
    assert list(options["--log-format"].choices) == ["json", "text"]
    assert list(options["--log-level"].choices) == ["debug", "info", "warning", "error"]
