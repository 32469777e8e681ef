"""Stopping background tasks so that none outlives its owner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

__all__ = ["stop_tasks"]


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has finished, also when the caller is
    cancelled meanwhile (its cancellation is re-raised once they are done; a second one
    stops the wait). Their results and exceptions are dropped: they were told to stop."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    if not pending:
        return
    waiter = asyncio.ensure_future(asyncio.wait(pending))
    try:
        await asyncio.shield(waiter)
    except asyncio.CancelledError:
        await waiter  # asyncio.wait never cancels what it waits for
        raise
    finally:
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: no "exception was never retrieved" noise
