"""cortex.edge.loop: uvloop where installed, asyncio's loop where not, a clear error else."""

from __future__ import annotations

import sys

import pytest

from cortex.edge.loop import choose_loop


async def loop_module() -> str:
    import asyncio
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def test_auto_falls_back_to_asyncio_where_uvloop_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop -> ImportError
    loop = choose_loop("auto")
    assert loop.name == "asyncio"
    assert loop.run(loop_module()) == "asyncio"
    with pytest.raises(ValueError, match="uvloop is not installed"):
        choose_loop("uvloop")


def test_auto_is_uvloop_where_installed() -> None:
    assert choose_loop().name.startswith("uvloop ")
    assert choose_loop().run(loop_module()) == "uvloop"
