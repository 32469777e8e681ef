"""The event loop every Cortex service runs on: uvloop where it is installed, asyncio's own
otherwise.

``CORTEX_EVENT_LOOP`` chooses (read by :func:`cortex.edge.serve.serve` from the environment it
is given): ``auto`` (the default: uvloop if it imports, else asyncio), ``uvloop`` (uvloop or
fail) or ``asyncio``. hypercorn, aiohttp, grpclib and pyzmq's asyncio sockets all run on
either loop; uvloop serves the same streams for less CPU. The loop in use is in every
service's startup log (``event loop: uvloop 0.23.0``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

__all__ = ["EVENT_LOOPS", "EventLoop", "choose_loop"]

T = TypeVar("T")

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True)
class EventLoop:
    """A loop to run on: its name for the logs (with its version), and its factory
    (``None``: asyncio's default loop)."""

    name: str
    factory: Callable[[], asyncio.AbstractEventLoop] | None

    def run(self, main: Coroutine[Any, Any, T]) -> T:
        """``asyncio.run(main)`` on this loop."""
        with asyncio.Runner(loop_factory=self.factory) as runner:
            return runner.run(main)


def choose_loop(wanted: str = "auto") -> EventLoop:
    """The loop for ``wanted`` (one of :data:`EVENT_LOOPS`); ``ValueError`` for another name,
    or for ``uvloop`` where uvloop is not installed."""
    if wanted not in EVENT_LOOPS:
        raise ValueError(f"event loop {wanted!r}: expected one of {', '.join(EVENT_LOOPS)}")
    if wanted != "asyncio":
        try:
            import uvloop
        except ImportError:
            if wanted == "uvloop":
                raise ValueError("event loop 'uvloop': uvloop is not installed") from None
        else:
            return EventLoop(f"uvloop {metadata.version('uvloop')}", uvloop.new_event_loop)
    return EventLoop("asyncio", None)
