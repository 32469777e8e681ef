"""What an engine says about its limits: the context length (parsers pure, fetch async).

vLLM: ``GET /v1/models`` → the served model's ``max_model_len``. SGLang: ``GET
/server_info`` (``/get_server_info`` before 0.4.7) → ``context_length``, else its
``/v1/models`` ``max_model_len``. A worker that reports nothing leaves the gateway with
the configured limits only. Both engines list their loaded LoRA adapters in ``/v1/models``
with the base model as ``parent``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from cortex.hashing import Engine
from cortex.registry.spec import WorkerSpec

__all__ = ["EngineInfo", "adapters_from_models", "context_length_from_models",
           "context_length_from_server_info", "fetch_engine_info"]

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


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any:
    async with session.get(url) as resp:
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
                            timeout_s: float) -> EngineInfo:
    """The worker's context length and adapters (each ``None`` when not reported)."""
    base = spec.url.rstrip("/")
    try:
        async with asyncio.timeout(timeout_s):
            found = None
            if spec.engine is Engine.SGLANG:
                for path in ("/server_info", "/get_server_info"):
                    found = context_length_from_server_info(await _get_json(session,
                                                                            base + path))
                    if found is not None:
                        break
            models = await _get_json(session, base + "/v1/models")
            if found is None:
                found = context_length_from_models(models, spec.model)
            return EngineInfo(found, adapters_from_models(models, spec.model))
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("engine info of worker=%s unavailable: %r", spec.id, exc,
                  extra={"worker": spec.id})
        return EngineInfo()
