"""How a simulated vLLM describes itself, the way vLLM 0.32 and 0.33 do (discovery endpoints).

- ``GET /kv_event_sources``: a JSON object keyed by data-parallel rank (``"0"``, ``"1"``,
  ...), each value the rank's resolved publisher config, all of vLLM's ``KVEventsConfig``
  fields (``enable_kv_cache_events``, ``publisher``, ``endpoint``, ``replay_endpoint``,
  ``buffer_steps``, ``hwm``, ``max_queue_size``, ``topic``); rank r on the base port + r.
  The endpoints are bind addresses (``tcp://*:PORT``), as vLLM's (it only binds an endpoint
  with ``*``): a subscriber reaches them at the worker's host. ``{}`` while nothing is bound;
- ``vllm:cache_config_info`` on ``GET /metrics``: an info gauge (value 1) whose labels carry
  the cache configuration, ``block_size`` among them.

SGLang's counterpart, the ``kv_events`` block of ``/server_info``, is part of that body
(:meth:`cortex.sim.routes.SimRoutes.server_info`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from aiohttp import web

from cortex.sim.config import SimConfig

__all__ = ["add_vllm_discovery_routes", "cache_config_info", "kv_event_sources"]

# vLLM's KVEventsConfig defaults, reported as the engine reports them
_BUFFER_STEPS = 10_000
_HWM = 100_000
_MAX_QUEUE_SIZE = 100_000


def kv_event_sources(config: SimConfig,
                     ports: Mapping[str, int | None]) -> dict[str, dict[str, Any]]:
    """vLLM's per-DP-rank publisher configs (empty while nothing is bound)."""
    events, replay = ports.get("kv_events"), ports.get("replay")
    if not events:
        return {}
    return {str(rank): {"enable_kv_cache_events": True, "publisher": "zmq",
                        "endpoint": f"tcp://*:{events + rank}",
                        "replay_endpoint": f"tcp://*:{replay + rank}" if replay else None,
                        "buffer_steps": _BUFFER_STEPS, "hwm": _HWM,
                        "max_queue_size": _MAX_QUEUE_SIZE, "topic": config.topic}
            for rank in range(config.dp_size)}


def cache_config_info(config: SimConfig) -> str:
    """The ``vllm:cache_config_info`` exposition lines (labels are strings, as vLLM's)."""
    labels = {"block_size": config.block_size, "cache_dtype": "auto",
              "enable_prefix_caching": True, "gpu_memory_utilization": 0.9,
              "num_gpu_blocks": config.kv_capacity_blocks, "num_cpu_blocks": "None",
              "prefix_caching_hash_algo": "sha256"}
    text = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f"vllm:cache_config_info{{{text}}} 1.0\n")


def add_vllm_discovery_routes(router: web.UrlDispatcher, config: SimConfig,
                              ports: Mapping[str, int | None]) -> None:
    """Serve ``GET /kv_event_sources`` (``ports``: filled in once the sim is bound)."""

    async def sources(_: web.Request) -> web.Response:
        return web.json_response(kv_event_sources(config, ports))

    router.add_get("/kv_event_sources", sources)
