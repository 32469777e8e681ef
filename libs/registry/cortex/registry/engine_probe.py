"""Ask a worker's engine about itself over HTTP (the thin shell of
:mod:`.engine_spec`, which merges the answers into a spec).

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
from cortex.registry.engine_spec import Discovery
from cortex.registry.engines import (
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
    """One endpoint gave no usable answer (the message says why); ``unreachable``: nothing
    answered at all, so asking the next endpoint is pointless."""

    def __init__(self, reason: str, unreachable: bool = False) -> None:
        super().__init__(reason)
        self.unreachable = unreachable


class _Probe:
    """GETs against one worker, collecting what failed as ``problems``."""

    def __init__(self, client: aiohttp.ClientSession, url: str, headers: dict[str, str],
                 timeout_s: float) -> None:
        self.client, self.url, self.headers, self.timeout_s = client, url, headers, timeout_s
        self.problems: list[str] = []
        self.unreachable = False

    async def get(self, path: str) -> tuple[int, bytes] | None:
        if self.unreachable:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                async with self.client.get(self.url + path, headers=self.headers,
                                           allow_redirects=False) as response:
                    # read to the end: one read() returns only what has arrived, and a
                    # real vLLM's /metrics (~50 KB) can come in more than one piece
                    body = bytearray()
                    async for chunk in response.content.iter_any():
                        body += chunk
                        if len(body) > _MAX_BODY:
                            raise _Failed(f"answer larger than {_MAX_BODY} bytes")
                    return response.status, bytes(body)
        except TimeoutError:
            self._failed(path, _Failed(f"no answer within {self.timeout_s:g} s", True))
        except aiohttp.ClientError as exc:
            self._failed(path, _Failed(f"cannot connect ({exc.__class__.__name__}: {exc})", True))
        except _Failed as exc:
            self._failed(path, exc)
        return None

    async def json(self, path: str) -> Any:
        answer = await self.get(path)
        if answer is None:
            return None
        status, body = answer
        if status != 200:
            self._failed(path, _Failed(f"HTTP {status}"))
            return None
        try:
            return json.loads(body)
        except ValueError:
            self._failed(path, _Failed("not JSON"))
            return None

    def _failed(self, path: str, failure: _Failed) -> None:
        self.problems.append(f"GET {path}: {failure}")
        self.unreachable = self.unreachable or failure.unreachable


async def discover(url: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                   session: aiohttp.ClientSession | None = None,
                   authorization: str | None = None) -> Discovery:
    """What the worker at ``url`` (a base URL) says about itself.

    ``timeout_s`` bounds each request (a discovery makes at most five, one after the other,
    and none after the worker did not answer one); ``authorization``: an ``Authorization``
    header value for engines started with an API key. Raises :class:`SpecError` only for a
    URL that is no base URL at all.
    """
    url = url.rstrip("/")
    WorkerSpec(id="probe", url=url, engine=Engine.SGLANG, model="probe")  # URL check only
    headers = {"Accept": "application/json"}
    if authorization:
        headers["Authorization"] = authorization
    client = session or aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeout_s))
    probe = _Probe(client, url, headers, timeout_s)
    try:
        answers, models = await _ask(probe)
    finally:
        if session is None:
            await client.close()
    engine = Discovery.merge(url, answers).engine
    # an endpoint only the other engine serves is no problem of this worker
    problems = [p for p in probe.problems if not _foreign(p, engine)]
    return Discovery.merge(url, answers, problems, models)


async def _ask(probe: _Probe) -> tuple[list[tuple[str, Learned]], tuple[str, ...]]:
    """SGLang's self-description first; the OpenAI model list; vLLM's endpoints when the
    worker is not SGLang."""
    answers: list[tuple[str, Learned]] = []
    models: tuple[str, ...] = ()
    info = None
    for path in ("/server_info", "/get_server_info"):
        body = await probe.json(path)
        if looks_like_sglang(body):
            info = body
            answers.append((f"GET {path}", parse_sglang_server_info(body)))
            break
        if body is not None:  # vLLM's dev-mode /server_info shares the path
            probe.problems.append(f"GET {path}: not an SGLang server_info")
    listing = await probe.json("/v1/models")
    if isinstance(listing, dict):
        learned, models = parse_v1_models(listing)
        answers.append(("GET /v1/models", learned))
    elif listing is not None:
        probe.problems.append("GET /v1/models: not a model list")
    if info is not None or Discovery.merge(probe.url, answers).engine is Engine.SGLANG:
        return answers, models
    sources = await probe.json("/kv_event_sources")
    if sources is not None:
        learned, problem = parse_vllm_kv_event_sources(sources)
        if problem is not None:
            probe.problems.append(f"GET /kv_event_sources: {problem}")
        # only vLLM serves it: it names the engine when /v1/models did not
        answers.append(("GET /kv_event_sources", {**learned, "engine": Engine.VLLM}))
    metrics = await probe.get("/metrics")
    if metrics is not None and metrics[0] != 200:
        probe.problems.append(f"GET /metrics: HTTP {metrics[0]}")
    elif metrics is not None:
        said = parse_vllm_metrics(metrics[1].decode("utf-8", "replace"))
        answers.append(("GET /metrics", said.learned))
        if said.problem is not None:
            probe.problems.append(f"GET /metrics: {said.problem}")
    return answers, models


def _foreign(problem: str, engine: Engine | None) -> bool:
    sglang_only = problem.startswith(("GET /server_info:", "GET /get_server_info:"))
    return engine is Engine.VLLM and sglang_only
