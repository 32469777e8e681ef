"""How many blocks a worker can hold, as it reports it: the bound of its sources' ledgers
(the answers are read by :mod:`cortex.registry.engines`).

- vLLM: ``GET /metrics``, the ``vllm:cache_config_info`` info gauge's ``num_gpu_blocks``
  label (per engine, i.e. per data-parallel rank) and, when it is a number,
  ``num_cpu_blocks`` (the CPU offload pool).
- SGLang: ``GET /server_info`` (``/get_server_info`` before 0.4.7): ``max_total_num_tokens``
  (the KV pool in tokens, per rank) over ``page_size`` (tokens per block).

:func:`ask_capacity` asks until the worker answers: a worker that is not up yet, refuses
the connection, times out, answers 5xx or refuses the credential (401/403: a rotated key
file is read again) is asked again with a growing pause (``first_s``
doubling up to ``max_s``), so a slow start never leaves its sources unbounded. An answer
that does not name a capacity (a 404, an engine too old to say) is final: no bound.

:func:`block_bound` turns that into the most blocks one source may be credited with: the
capacity with a margin (events in flight around an eviction), plus the blocks of offload
tiers the operator configured. ``None`` when the worker does not say (no bound then).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable

import aiohttp

from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.engines import (
    kv_capacity_from_sglang_server_info,
    kv_capacity_from_vllm_metrics,
)

__all__ = ["CapacityUnreachable", "ask_capacity", "block_bound", "fetch_capacity"]

log = logging.getLogger(__name__)


class CapacityUnreachable(Exception):
    """The worker could not be asked (connection, timeout, 5xx, a refused credential): ask
    again later."""


async def fetch_capacity(session: aiohttp.ClientSession, spec: WorkerSpec,
                         headers: dict[str, str] | None = None) -> int | None:
    """Blocks ``spec``'s worker reports it can hold per rank (None: it does not say).
    Raises :class:`CapacityUnreachable` when the worker could not be asked."""
    base = spec.url.rstrip("/")
    paths = ["/metrics"] if spec.engine is Engine.VLLM else ["/server_info", "/get_server_info"]
    try:
        for path in paths:
            async with session.get(base + path, headers=headers) as resp:
                if resp.status >= 500 or resp.status in (401, 403):  # a key may come later
                    raise CapacityUnreachable(f"{path} answered {resp.status}")
                if resp.status != 200:
                    continue
                if spec.engine is Engine.VLLM:
                    return kv_capacity_from_vllm_metrics(await resp.text())
                return kv_capacity_from_sglang_server_info(await resp.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise CapacityUnreachable(f"{type(exc).__name__}: {exc}") from exc
    except ValueError:  # a 200 that is not what the engine answers: it does not say
        return None
    return None


async def ask_capacity(session: aiohttp.ClientSession, spec: WorkerSpec,
                       headers: Callable[[], dict[str, str]], *, first_s: float = 0.5,
                       max_s: float = 30.0,
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
                       ) -> int | None:
    """:func:`fetch_capacity` until the worker answers (see the module docstring);
    ``headers`` is called before each try (a rotated credential is picked up)."""
    pause = first_s
    while True:
        try:
            return await fetch_capacity(session, spec, headers())
        except CapacityUnreachable as exc:
            log.info("worker=%s capacity not read (%s); asking again in %.1f s", spec.id,
                     exc, pause, extra={"worker": spec.id})
        await sleep(pause)
        pause = min(max_s, pause * 2)


def block_bound(capacity: int | None, margin: float, tier_blocks: int) -> int:
    """The most blocks one source may hold: ``capacity`` * (1 + ``margin``) +
    ``tier_blocks``; 0 (no bound) when the capacity is unknown."""
    if not capacity:
        return 0
    return math.ceil(capacity * (1.0 + margin)) + tier_blocks
