"""What an engine says about its limits: the context length (parsers pure, fetch async).

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
from cortex.registry.spec import WorkerSpec

__all__ = ["EngineInfo", "adapters_from_models", "context_length_from_models",
           "context_length_from_server_info", "fetch_engine_info", "fetch_sglang_lookahead",
           "fetch_vllm_version", "sglang_lookahead_from_server_info",
           "vllm_version_from_server_info"]

_SGLANG_EAGLE: frozenset[str] = frozenset({"EAGLE", "EAGLE3", "FROZEN_KV_MTP", "NEXTN"})

log = logging.getLogger(__name__)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def context_length_from_models(obj: Any, model: str) -> int | None:
    """``max_model_len`` of ``model`` in an OpenAI ``/v1/models`` answer (the only entry
    when the served name differs)."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    entries = [e for e in data if isinstance(e, dict)]
    named = [e for e in entries if e.get("id") == model] or (entries if len(entries) == 1
                                                             else [])
    return _positive_int(named[0].get("max_model_len")) if named else None


def adapters_from_models(obj: Any, model: str) -> frozenset[str] | None:
    """LoRA adapters of ``model`` in a ``/v1/models`` answer: the entries whose ``parent`` is
    ``model`` (vLLM ``serving_models.py::show_available_models``, SGLang
    ``http_server.py::available_models`` list each loaded adapter so). ``None``: no list."""
    data = obj.get("data") if isinstance(obj, dict) else None
    if not isinstance(data, list):
        return None
    return frozenset(e["id"] for e in data if isinstance(e, dict) and e.get("parent") == model
                     and isinstance(e.get("id"), str) and e["id"])


def context_length_from_server_info(obj: Any) -> int | None:
    """SGLang ``/server_info``'s ``context_length``."""
    return _positive_int(obj.get("context_length")) if isinstance(obj, dict) else None


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
                    found = context_length_from_server_info(await _get_json(
                        session, base + path, headers))
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


def vllm_version_from_server_info(obj: Any) -> str | None:
    """vLLM ``/server_info``'s ``system_env.vllm_version``."""
    env = obj.get("system_env") if isinstance(obj, dict) else None
    version = env.get("vllm_version") if isinstance(env, dict) else None
    return version.strip() or None if isinstance(version, str) else None


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


def sglang_lookahead_from_server_info(obj: Any) -> int | None:
    """Lookahead tokens of an SGLang worker's cache keys: 1 with an EAGLE radix cache, 0
    without speculative decoding or radix cache, ``None`` when its answer does not say
    (no server info, an algorithm registered by a plugin)."""
    if not isinstance(obj, dict) or "speculative_algorithm" not in obj:
        return None
    if obj.get("disable_radix_cache") is True:
        return 0
    algorithm = obj.get("speculative_algorithm")
    if algorithm is None or (isinstance(algorithm, str) and algorithm.upper() == "NONE"):
        return 0
    if not isinstance(algorithm, str):
        return None
    name = algorithm.upper()
    if name in _SGLANG_EAGLE:
        return 1
    return 0 if name in {"STANDALONE", "NGRAM", "DFLASH", "UNO", "DSPARK"} else None


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
