"""Ask a worker's engine about itself over HTTP (the thin shell of :mod:`.discovery`).

``await discover(url)`` reads SGLang's ``/server_info`` (else ``/get_server_info``), the
OpenAI ``/v1/models``, and for vLLM ``/kv_event_sources`` and ``/metrics``. Every request has
its own timeout and the whole discovery a deadline; an endpoint that fails is a
``problem`` of the result, never an exception: the caller decides what is required.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from cortex.hashing import Engine
from cortex.registry.discovery import (
    Discovery,
    Learned,
    looks_like_sglang,
    parse_sglang_server_info,
    parse_v1_models,
    parse_vllm_kv_event_sources,
    parse_vllm_metrics,
)
from cortex.registry.spec import WorkerSpec

__all__ = ["DEFAULT_TIMEOUT_S", "discover"]

DEFAULT_TIMEOUT_S = 5.0
_MAX_BODY = 8 * 1024 * 1024  # /metrics of a large DP engine stays far below this


class _Failed(Exception):
    """One endpoint gave no usable answer (the message says why)."""


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
               timeout_s: float) -> tuple[int, bytes]:
    try:
        async with asyncio.timeout(timeout_s):
            async with session.get(url, headers=headers, allow_redirects=False) as response:
                body = await response.content.read(_MAX_BODY + 1)
                if len(body) > _MAX_BODY:
                    raise _Failed(f"answer larger than {_MAX_BODY} bytes")
                return response.status, body
    except TimeoutError:
        raise _Failed(f"no answer within {timeout_s:g} s") from None
    except aiohttp.ClientError as exc:
        raise _Failed(f"cannot connect ({exc.__class__.__name__}: {exc})") from None


def _json(status: int, body: bytes) -> Any:
    if status != 200:
        raise _Failed(f"HTTP {status}")
    try:
        return json.loads(body)
    except ValueError:
        raise _Failed("not JSON") from None


async def discover(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   session: aiohttp.ClientSession | None = None,
                   authorization: str | None = None) -> Discovery:
    """What the worker at ``url`` (a base URL) says about itself.

    ``timeout_s`` bounds each request (the whole discovery takes at most four of them);
    ``authorization``: an ``Authorization`` header value for engines started with an API
    key. Raises :class:`SpecError` only for a URL that is no base URL at all.
    """
    url = url.rstrip("/")
    WorkerSpec(id="probe", url=url, engine=Engine.SGLANG, model="probe")  # URL check only
    headers = {"Accept": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    owned = session is None
    client = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s))
    answers: list[tuple[str, Learned]] = []
    problems: list[str] = []
    models: tuple[str, ...] = ()

    async def fetch(path: str) -> tuple[int, bytes] | None:
        try:
            return await _get(client, url + path, headers, timeout_s)
        except _Failed as exc:
            problems.append(f"GET {path}: {exc}")
            return None

    def read_json(path: str, answer: tuple[int, bytes] | None) -> Any:
        if answer is None:
            return None
        try:
            return _json(*answer)
        except _Failed as exc:
            problems.append(f"GET {path}: {exc}")
            return None

    try:
        info, info_path = None, "/server_info"
        for path in ("/server_info", "/get_server_info"):
            answer = await fetch(path)
            if answer is None:
                break  # nothing answers at all: the next path would not either
            body = read_json(path, answer)
            if looks_like_sglang(body):
                info, info_path = body, path
                break
            if body is not None:
                problems.append(f"GET {path}: not an SGLang server_info")
        if info is not None:
            answers.append((f"GET {info_path}", parse_sglang_server_info(info)))
        models_body = (read_json("/v1/models", await fetch("/v1/models"))
                       if _answered(problems) else None)
        if isinstance(models_body, dict):
            learned, models = parse_v1_models(models_body)
            answers.append(("GET /v1/models", learned))
        elif models_body is not None:
            problems.append("GET /v1/models: not a model list")
        engine = Discovery.merge(url, answers).engine
        if info is None and engine is not Engine.SGLANG and _answered(problems):
            sources = read_json("/kv_event_sources", await fetch("/kv_event_sources"))
            if sources is not None:
                learned, problem = parse_vllm_kv_event_sources(sources)
                if problem is not None:
                    problems.append(f"GET /kv_event_sources: {problem}")
                # only vLLM serves it: it names the engine when /v1/models did not
                answers.append(("GET /kv_event_sources", {**learned, "engine": Engine.VLLM}))
            metrics = await fetch("/metrics")
            if metrics is not None and metrics[0] == 200:
                learned = parse_vllm_metrics(metrics[1].decode("utf-8", "replace"))
                if learned:
                    answers.append(("GET /metrics", learned))
                else:
                    problems.append("GET /metrics: no vllm:cache_config_info block_size")
            elif metrics is not None:
                problems.append(f"GET /metrics: HTTP {metrics[0]}")
    finally:
        if owned:
            await client.close()
    if any(name in learned for _, learned in answers for name in ("engine", "model")):
        # an endpoint the other engine does not serve is no problem of this worker
        problems = [p for p in problems if not _foreign(p, Discovery.merge(url, answers).engine)]
    return Discovery.merge(url, answers, problems, models)


def _answered(problems: list[str]) -> bool:
    """Whether the worker answers HTTP at all (no connection failure or timeout yet)."""
    return not any("cannot connect" in p or "no answer within" in p for p in problems)


def _foreign(problem: str, engine: Engine | None) -> bool:
    sglang_only = problem.startswith(("GET /server_info:", "GET /get_server_info:"))
    return engine is Engine.VLLM and sglang_only
