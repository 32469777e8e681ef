"""What an engine says about its limits, fetched (the answers' parsers are
:mod:`cortex.registry.engines`): the context length, the adapters, the version, the lookahead.

vLLM: ``GET /v1/models`` → the served model's ``max_model_len``. SGLang: ``GET
/server_info`` (``/get_server_info`` before 0.4.7) → ``context_length``, else its
``/v1/models`` ``max_model_len``. A worker that reports nothing leaves the gateway with
the configured limits only. Both engines list their loaded LoRA adapters in ``/v1/models``
with the base model as ``parent``.

vLLM's version (``GET /server_info?config_format=json`` → ``system_env.vllm_version``,
``entrypoints/serve/dev/server_info``; served when the engine runs with
``VLLM_SERVER_DEV_MODE=1``) decides which prefill and decode workers can be paired: the
NIXL connector's compatibility hash covers it (``kv_connector/v1/nixl/metadata.py``).

SGLang's ``/server_info`` carries its server args: ``speculative_algorithm`` EAGLE, EAGLE3,
FROZEN_KV_MTP or the alias NEXTN (``srt/speculative/spec_info.py::is_eagle``) with the radix
cache on means bigram radix keys — lookahead 1 (``docs/ingest.md``). vLLM's speculative
config decides its lookahead through rules this gateway does not replicate: its workers
announce it in their spec.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from cortex.hashing import Engine
from cortex.registry.engines import (
    adapters_from_models,
    context_length_from_models,
    parse_sglang_server_info,
    sglang_lookahead_from_server_info,
    vllm_version_from_server_info,
)
from cortex.registry.spec import WorkerSpec

__all__ = ["EngineInfo", "fetch_engine_info", "fetch_sglang_lookahead", "fetch_vllm_version"]

log = logging.getLogger(__name__)


async def _get_json(session: aiohttp.ClientSession, url: str,
                    headers: Mapping[str, str]) -> Any:
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            return None
        try:
            return json.loads(await resp.read())
        except ValueError:
            return None


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a worker said: its context length (tokens) and its LoRA adapters (``None``:
    not reported or unreachable)."""

    context_length: int | None = None
    adapters: frozenset[str] | None = None


async def fetch_engine_info(session: aiohttp.ClientSession, spec: WorkerSpec,
                            timeout_s: float, headers: Mapping[str, str] | None = None
                            ) -> EngineInfo:
    """The worker's context length and adapters (each ``None`` when not reported);
    ``headers``: the worker's credential."""
    headers = headers or {}
    base = spec.url.rstrip("/")
    try:
        async with asyncio.timeout(timeout_s):
            found = None
            if spec.engine is Engine.SGLANG:
                for path in ("/server_info", "/get_server_info"):
                    info = await _get_json(session, base + path, headers)
                    if isinstance(info, Mapping):
                        found = parse_sglang_server_info(info).get("context_length")
                    if found is not None:
                        break
            models = await _get_json(session, base + "/v1/models", headers)
            if found is None:
                found = context_length_from_models(models, spec.model)
            return EngineInfo(found, adapters_from_models(models, spec.model))
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("engine info of worker=%s unavailable: %r", spec.id, exc,
                  extra={"worker": spec.id})
        return EngineInfo()


async def fetch_vllm_version(session: aiohttp.ClientSession, spec: WorkerSpec,
                             timeout_s: float, headers: Mapping[str, str] | None = None
                             ) -> str | None:
    """A vLLM worker's version, or ``None`` (not served, unreachable, another engine);
    ``headers``: the worker's credential."""
    if spec.engine is not Engine.VLLM:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            return vllm_version_from_server_info(await _get_json(
                session, spec.url.rstrip("/") + "/server_info?config_format=json", headers or {}))
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("server info of worker=%s unavailable: %r", spec.id, exc,
                  extra={"worker": spec.id})
        return None


async def fetch_sglang_lookahead(session: aiohttp.ClientSession, spec: WorkerSpec,
                                 timeout_s: float, headers: Mapping[str, str] | None = None
                                 ) -> int | None:
    """An SGLang worker's lookahead from its ``/server_info``, or ``None``; ``headers``: the
    worker's credential."""
    if spec.engine is not Engine.SGLANG:
        return None
    try:
        async with asyncio.timeout(timeout_s):
            return sglang_lookahead_from_server_info(
                await _get_json(session, spec.url.rstrip("/") + "/server_info", headers or {}))
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("server info of worker=%s unavailable: %r", spec.id, exc,
                  extra={"worker": spec.id})
        return None
