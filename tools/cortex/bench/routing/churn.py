"""Churn during a run: restart one worker empty, flush another, on the run's clock.

A restart is the sim's restart fault (``POST /sim/restart``): the engine comes back with an
empty cache and its event ``seq`` from 0 and publishes ``AllBlocksCleared``, as a restarted
SGLang does; requests in flight finish (a process restart would fail them, and every
request must be answered for a run to count). A flush is SGLang's ``/flush_cache``, which
the engine refuses while requests run or wait: it is retried every 10 ms until accepted
(at most :data:`FLUSH_DEADLINE_S`), and the event's time is when it was accepted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from cortex.bench.routing.scenarios import ChurnAction, ChurnEvent

__all__ = ["FLUSH_DEADLINE_S", "ChurnRecord", "churn_driver"]

FLUSH_DEADLINE_S = 30.0
_RETRY_S = 0.01


@dataclass(slots=True)
class ChurnRecord:
    """What happened: ``at_s`` on the run's clock (``None``: never accepted), ``attempts``."""

    action: ChurnAction
    worker: str
    planned_s: float
    at_s: float | None = None
    attempts: int = 0


async def _apply(session: aiohttp.ClientSession, url: str, record: ChurnRecord,
                 clock: Callable[[], float]) -> None:
    path = "/sim/restart" if record.action is ChurnAction.RESTART else "/flush_cache"
    deadline = clock() + FLUSH_DEADLINE_S
    while clock() < deadline:
        record.attempts += 1
        async with session.post(url + path) as resp:
            await resp.read()
            if resp.status == 200:
                record.at_s = clock()
                return
        await asyncio.sleep(_RETRY_S)


def churn_driver(events: Sequence[ChurnEvent], workers: Mapping[str, str], span_s: float,
                 records: list[ChurnRecord]
                 ) -> Callable[[Callable[[], float]], Coroutine[Any, Any, None]]:
    """A ``during`` coroutine function for :func:`cortex.bench.routing.client.drive`: each
    event at ``fraction * span_s`` on worker number ``worker`` (in ``workers`` order),
    appended to ``records`` as it is planned."""
    ids = list(workers)

    async def run(clock: Callable[[], float]) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for event in sorted(events, key=lambda e: e.fraction):
                wid = ids[event.worker % len(ids)]
                record = ChurnRecord(event.action, wid, event.fraction * span_s)
                records.append(record)
                delay = record.planned_s - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                await _apply(session, workers[wid], record, clock)

    return run
