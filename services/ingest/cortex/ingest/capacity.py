"""How many blocks a worker can hold, as it reports it: the bound of its sources' ledgers.

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
import re
from typing import Any

import aiohttp

from cortex.hashing import Engine
from cortex.registry import WorkerSpec

__all__ = ["block_bound", "fetch_capacity", "sglang_capacity", "vllm_capacity"]

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def vllm_capacity(metrics: str) -> int | None:
    """GPU + CPU blocks from vLLM's ``/metrics`` text (None when absent)."""
    found = _CACHE_INFO.search(metrics)
    if found is None:
        return None
    labels = dict(_LABEL.findall(found["labels"]))
    gpu, cpu = labels.get("num_gpu_blocks", ""), labels.get("num_cpu_blocks", "")
    if not gpu.isdigit():
        return None
    return int(gpu) + (int(cpu) if cpu.isdigit() else 0)  # "None" without a CPU pool


def sglang_capacity(info: Any) -> int | None:
    """Blocks of SGLang's KV pool from its ``/server_info`` body (None when absent)."""
    if not isinstance(info, dict):
        return None
    tokens, page = info.get("max_total_num_tokens"), info.get("page_size") or 1
    if not isinstance(tokens, int) or not isinstance(page, int) or tokens < 1 or page < 1:
        return None
    return math.ceil(tokens / page)


async def fetch_capacity(session: aiohttp.ClientSession, spec: WorkerSpec,
                         headers: dict[str, str] | None = None) -> int | None:
    """Blocks ``spec``'s worker reports it can hold per rank (None: it does not say, or it
    could not be asked)."""
    base = spec.url.rstrip("/")
    try:
        if spec.engine is Engine.VLLM:
            async with session.get(base + "/metrics", headers=headers) as resp:
                return vllm_capacity(await resp.text()) if resp.status == 200 else None
        for path in ("/server_info", "/get_server_info"):
            async with session.get(base + path, headers=headers) as resp:
                if resp.status == 200:
                    return sglang_capacity(await resp.json(content_type=None))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None
    return None


def block_bound(capacity: int | None, margin: float, tier_blocks: int) -> int:
    """The most blocks one source may hold: ``capacity`` * (1 + ``margin``) +
    ``tier_blocks``; 0 (no bound) when the capacity is unknown."""
    if not capacity:
        return 0
    return math.ceil(capacity * (1.0 + margin)) + tier_blocks
