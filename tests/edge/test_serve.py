"""cortex.edge.serve: logging, stop signals and exit codes of every service process."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal

import pytest

from cortex.edge.serve import add_logging_flags, serve
from cortex.edge.settings import SettingsError

pytestmark = pytest.mark.timeout(10)


class BadSetting(ValueError):
    pass


def parse(*argv: str, level: str = "info", log_format: str = "text") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_logging_flags(parser, "demo", level=level, log_format=log_format)
    return parser.parse_args(argv)


def test_a_clean_stop_on_sigterm_is_0() -> None:
    seen: list[object] = []

    async def main(config: object, stop: asyncio.Event) -> None:
        seen.append(config)
        os.kill(os.getpid(), signal.SIGTERM)
        await stop.wait()

    assert serve("demo", parse(), {}, lambda: "the config", main) == 0
    assert seen == ["the config"]


@pytest.mark.parametrize("error", [SettingsError("CORTEX_DEMO_PORT", "must be an integer"),
                                   BadSetting("port: out of range")])
def test_a_bad_setting_is_2_with_one_line(error: Exception,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    def load() -> object:
        raise error

    async def main(config: object, stop: asyncio.Event) -> None:
        raise AssertionError("must not start")

    assert serve("demo", parse(), {}, load, main, config_errors=(BadSetting,)) == 2
    assert capsys.readouterr().err == f"cortex demo: invalid configuration: {error}\n"


def test_a_bad_setting_found_at_start_is_2_and_a_start_failure_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def token(config: object, stop: asyncio.Event) -> None:
        raise BadSetting("cannot read the token file /x")

    async def taken(config: object, stop: asyncio.Event) -> None:
        raise OSError(98, "address already in use")

    assert serve("demo", parse(), {}, lambda: 1, token, config_errors=(BadSetting,)) == 2
    assert "cortex demo: invalid configuration: cannot read the token file" in \
        capsys.readouterr().err
    assert serve("demo", parse(), {}, lambda: 1, taken) == 1
    assert capsys.readouterr().err.splitlines()[-1].startswith("cortex demo: cannot start: ")


@pytest.mark.parametrize(("wanted", "loop_module"), [("auto", "uvloop"), ("uvloop", "uvloop"),
                                                     ("asyncio", "asyncio")])
def test_the_service_runs_on_the_event_loop_named_and_logs_it(
    wanted: str, loop_module: str, capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[str] = []

    async def main(config: object, stop: asyncio.Event) -> None:
        seen.append(type(asyncio.get_running_loop()).__module__.split(".")[0])

    assert serve("demo", parse(), {"CORTEX_EVENT_LOOP": wanted}, lambda: 1, main) == 0
    assert seen == [loop_module]
    assert f"event loop: {loop_module}" in capsys.readouterr().err


def test_an_unknown_event_loop_is_a_bad_setting(capsys: pytest.CaptureFixture[str]) -> None:
    async def main(config: object, stop: asyncio.Event) -> None:
        raise AssertionError("must not start")

    assert serve("demo", parse(), {"CORTEX_EVENT_LOOP": "trio"}, lambda: 1, main) == 2
    assert "invalid configuration: event loop 'trio'" in capsys.readouterr().err


def test_logging_flag_then_environment_then_the_service_default() -> None:
    async def main(config: object, stop: asyncio.Event) -> None:
        seen.append(logging.getLogger().level)

    seen: list[int] = []
    serve("demo", parse(level="warning"), {}, lambda: 1, main)
    serve("demo", parse(), {"CORTEX_DEMO_LOG_LEVEL": "ERROR"}, lambda: 1, main)
    serve("demo", parse("--log-level", "debug"), {"CORTEX_DEMO_LOG_LEVEL": "error"}, lambda: 1,
          main)
    assert seen == [logging.WARNING, logging.ERROR, logging.DEBUG]
