"""How many blocks a worker can hold, as it reports it: the bound of its sources' ledgers
(the answers are read by :mod:`cortex.registry.engines`).

- vLLM: ``GET /metrics``, the ``vllm:cache_config_info`` info gauge's ``num_gpu_blocks``
  label (per engine, i.e. per data-parallel rank) and, when it is a number,
  ``num_cpu_blocks`` (the CPU offload pool).
- SGLang: ``GET /server_info`` (``/get_server_info`` before 0.4.7): ``max_total_num_tokens``
  (the KV pool in tokens, per rank) over ``page_size`` (tokens per block).

:func:`block_bound` turns that into the most blocks one source may be credited with: the
capacity with a margin (events in flight around an eviction), plus the blocks of offload
tiers the operator configured. ``None`` when the worker does not say (no bound then).
"""

from __future__ import annotations

import math

import aiohttp

from cortex.hashing import Engine
from cortex.registry import WorkerSpec
from cortex.registry.engines import (
    kv_capacity_from_sglang_server_info,
    kv_capacity_from_vllm_metrics,
)

__all__ = ["block_bound", "fetch_capacity"]


async def fetch_capacity(session: aiohttp.ClientSession, spec: WorkerSpec,
                         headers: dict[str, str] | None = None) -> int | None:
    """Blocks ``spec``'s worker reports it can hold per rank (None: it does not say, or it
    could not be asked)."""
    base = spec.url.rstrip("/")
    try:
        if spec.engine is Engine.VLLM:
            async with session.get(base + "/metrics", headers=headers) as resp:
                return (kv_capacity_from_vllm_metrics(await resp.text())
                        if resp.status == 200 else None)
        for path in ("/server_info", "/get_server_info"):
            async with session.get(base + path, headers=headers) as resp:
                if resp.status == 200:
                    return kv_capacity_from_sglang_server_info(
                        await resp.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return None


def block_bound(capacity: int | None, margin: float, tier_blocks: int) -> int:
    """The most blocks one source may hold: ``capacity`` * (1 + ``margin``) +
    ``tier_blocks``; 0 (no bound) when the capacity is unknown."""
    if not capacity:
        return 0
    return math.ceil(capacity * (1.0 + margin)) + tier_blocks
