"""The connection bounds are tested on both event loops a gateway can run on
(cortex.edge.loop): they must hold on uvloop too, which accepts connections in C, never
through the listening socket's ``accept``. The other tests run on asyncio's loop only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest
import uvloop

LoopFactories = Mapping[str, Callable[[], asyncio.AbstractEventLoop]]

BOTH_LOOPS: LoopFactories = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
BOUNDS_TESTS = ("test_a_connection_closed_before_a_request_frees_its_place_at_once",
                "test_one_address_cannot_take_every_place")


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item
                                  ) -> LoopFactories:
    if item.name.startswith(BOUNDS_TESTS):
        return BOTH_LOOPS
    return {"asyncio": asyncio.new_event_loop}
