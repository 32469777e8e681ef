"""What an engine says about its limits: the context length (parsers pure, fetch async).

vLLM: ``GET /v1/models`` → the served model's ``max_model_len``. SGLang: ``GET
/server_info`` (``/get_server_info`` before 0.4.7) → ``context_length``, else its
``/v1/models`` ``max_model_len``. A worker that reports nothing leaves the gateway with
the configured limits only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from cortex.hashing import Engine
from cortex.registry.spec import WorkerSpec

__all__ = ["context_length_from_models", "context_length_from_server_info",
           "fetch_context_length"]

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


async def fetch_context_length(session: aiohttp.ClientSession, spec: WorkerSpec,
                               timeout_s: float, headers: Mapping[str, str] | None = None
                               ) -> int | None:
    """The worker's context length in tokens, or ``None`` (not reported, unreachable);
    ``headers``: the worker's credential."""
    headers = headers or {}
    base = spec.url.rstrip("/")
    try:
        async with asyncio.timeout(timeout_s):
            if spec.engine is Engine.SGLANG:
                for path in ("/server_info", "/get_server_info"):
                    found = context_length_from_server_info(await _get_json(
                        session, base + path, headers))
                    if found is not None:
                        return found
            return context_length_from_models(
                await _get_json(session, base + "/v1/models", headers), spec.model)
    except (TimeoutError, aiohttp.ClientError) as exc:
        log.debug("engine info of worker=%s unavailable: %r", spec.id, exc,
                  extra={"worker": spec.id})
        return None
