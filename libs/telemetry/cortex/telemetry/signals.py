"""How every Cortex service is told to stop: SIGTERM or SIGINT, as an event on its loop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

__all__ = ["stop_signals"]

_STOP = (signal.SIGTERM, signal.SIGINT)


@contextlib.contextmanager
def stop_signals() -> Iterator[asyncio.Event]:
    """An event the running loop sets on SIGTERM or SIGINT while the block runs (every
    signal sets it again: a service may ``clear()`` it to hear a second one); the handlers
    are removed on exit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in _STOP:
        with contextlib.suppress(NotImplementedError):  # platforms without signal handlers
            loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in _STOP:
            with contextlib.suppress(NotImplementedError):
                loop.remove_signal_handler(sig)
