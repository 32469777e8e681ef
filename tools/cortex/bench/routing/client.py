"""The load generator: sends a workload's requests on schedule and records what happened.

Open-loop requests go out at their ``at_s`` whatever the contender's latency; a request that
follows another one (a client's next round) goes out ``at_s`` after that one completed. Every
request is streamed; TTFT is the time to the first chunk carrying generated text, E2E the
time to ``[DONE]`` (a Messages / Responses stream: to the end of its last event).

Each request opens its own connection (``force_close``), as independent clients would, and
for every contender alike: on a reused keep-alive connection ``sglang-router`` 0.3.2 delays
each streamed response here by ~40 ms (small writes waiting for a delayed ACK), which would
be charged to its routing otherwise.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from cortex.bench.routing.metrics import Outcome
from cortex.bench.routing.workloads import Endpoint, Request, Workload
from cortex.sim.routes import SERVED_BY_HEADER

__all__ = ["HEADER_HIT", "HEADER_REUSE", "HEADER_WORKER", "drive", "idle_ttft", "reuse_fields"]

HEADER_HIT = "x-cortex-cache-hit-tokens"
HEADER_WORKER = "x-cortex-assigned-worker"
HEADER_REUSE = "x-cortex-reuse"
START_LEAD_S = 0.2
"""Head start between creating the schedule and the first send time (s)."""


def _text_of(chunk: dict[str, Any], endpoint: Endpoint) -> str:
    if endpoint is Endpoint.MESSAGES:
        delta = chunk.get("delta") if chunk.get("type") == "content_block_delta" else None
        return str(delta.get("text") or "") if isinstance(delta, dict) else ""
    if endpoint is Endpoint.RESPONSES:
        return (str(chunk.get("delta") or "")
                if chunk.get("type") == "response.output_text.delta" else "")
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint is Endpoint.COMPLETIONS:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


def reuse_fields(value: str | None) -> dict[str, str]:
    """The ``key=value`` fields of an ``x-cortex-reuse`` header (empty when absent)."""
    if not value:
        return {}
    fields = (part.strip().partition("=") for part in value.split(";"))
    return {k: v for k, _, v in fields if k}


ANTHROPIC_INPUT_COUNTS_CACHED = True
"""The routing benchmark's sims are SGLang: its Messages usage counts every prompt token in
``input_tokens`` (vLLM's leaves the ``cache_read_input_tokens`` out)."""


def _usage(chunk: dict[str, Any], endpoint: Endpoint, outcome: Outcome) -> bool:
    """Fill ``outcome``'s token counts from the event carrying the final usage; ``True``
    when the event ends a named-event stream (Messages, Responses: no ``[DONE]``)."""
    kind = chunk.get("type")
    if endpoint is Endpoint.MESSAGES:
        usage = chunk.get("usage") if kind == "message_delta" else None
        if isinstance(usage, dict):
            cached = int(usage.get("cache_read_input_tokens") or 0)
            outcome.prompt_tokens = int(usage["input_tokens"]) + (
                0 if ANTHROPIC_INPUT_COUNTS_CACHED else cached)
            outcome.completion_tokens = int(usage["output_tokens"])
            outcome.cached_tokens = cached
        return kind == "message_stop"
    if endpoint is Endpoint.RESPONSES:
        if kind != "response.completed":
            return False
        usage = chunk["response"]["usage"]
        outcome.prompt_tokens = int(usage["input_tokens"])
        outcome.completion_tokens = int(usage["output_tokens"])
        outcome.cached_tokens = int((usage.get("input_tokens_details") or {})
                                    .get("cached_tokens") or 0)
        return True
    usage = chunk.get("usage")
    if usage:
        outcome.prompt_tokens = int(usage["prompt_tokens"])
        outcome.completion_tokens = int(usage["completion_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        outcome.cached_tokens = int(details.get("cached_tokens") or 0)
    return False


async def _send(session: aiohttp.ClientSession, url: str, model: str, request: Request,
                outcome: Outcome, clock: Callable[[], float]) -> None:
    """Stream one request, filling ``outcome`` (errors become ``outcome.error``)."""
    body = request.body(model)
    try:
        async with session.post(url + request.endpoint.path, json=body,
                                headers=request.headers()) as resp:
            if resp.status != 200:
                await resp.read()
                outcome.error = f"http {resp.status}"
                return
            hit = resp.headers.get(HEADER_HIT)
            outcome.predicted_hit_tokens = int(hit) if hit is not None else None
            outcome.worker = resp.headers.get(HEADER_WORKER)
            reuse = reuse_fields(resp.headers.get(HEADER_REUSE))
            if reuse.get("available", "").isdigit() and reuse.get("captured", "").isdigit():
                outcome.reuse_available = int(reuse["available"])
                outcome.reuse_captured = int(reuse["captured"])
            served = resp.headers.get(SERVED_BY_HEADER)
            outcome.served_port = int(served) if served and served.isdigit() else None
            done = False
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    done = True  # read on to the end of the body: a clean close
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = "stream error"
                    return
                if outcome.ttft_s is None and _text_of(chunk, request.endpoint):
                    outcome.ttft_s = clock() - outcome.sent_s
                done = _usage(chunk, request.endpoint, outcome) or done
            outcome.done_s = clock()
            if not done:
                outcome.error = "stream cut"
            elif outcome.prompt_tokens is None:
                outcome.error = "no usage"
            elif outcome.ttft_s is None:
                outcome.error = "no text"
    except TimeoutError:
        outcome.error = "timeout"
    except (aiohttp.ClientError, ValueError, KeyError) as exc:
        outcome.error = f"client: {type(exc).__name__}"


async def drive(workload: Workload, url: str, model: str, *, timeout_s: float = 300.0,
                progress: Callable[[int, int], None] | None = None,
                during: Callable[[Callable[[], float]], Coroutine[Any, Any, None]] | None = None
                ) -> list[Outcome]:
    """Run the whole workload against ``url``; one :class:`Outcome` per request sent.
    ``during(clock)`` runs beside the requests (churn events on the run's clock, s) and is
    awaited before this returns."""
    loop = asyncio.get_running_loop()
    start = loop.time() + START_LEAD_S

    def clock() -> float:
        return loop.time() - start

    followers: dict[int, list[Request]] = defaultdict(list)
    for r in workload.requests:
        if r.after is not None:
            followers[r.after].append(r)
    outcomes: list[Outcome] = []
    finished = 0
    tasks: set[asyncio.Task[None]] = set()
    all_done = asyncio.Event()
    total = len(workload.requests)
    if total == 0:
        return outcomes

    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def run(request: Request, scheduled_s: float) -> None:
            nonlocal finished
            delay = scheduled_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            outcome = Outcome(request.id, request.digest(), scheduled_s, clock())
            outcomes.append(outcome)
            await _send(session, url, model, request, outcome, clock)
            now = clock()
            for nxt in followers.get(request.id, ()):
                spawn(nxt, now + nxt.at_s)
            finished += 1
            if progress is not None:
                progress(finished, total)
            if finished == total:
                all_done.set()

        def spawn(request: Request, scheduled_s: float) -> None:
            task = asyncio.create_task(run(request, scheduled_s))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        for r in workload.requests:
            if r.after is None:
                spawn(r, r.at_s)
        side = asyncio.create_task(during(clock)) if during is not None else None
        try:
            await all_done.wait()
            if side is not None:
                await side
        finally:
            for task in [*tasks, *([side] if side is not None else [])]:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if side is not None:
                await asyncio.gather(side, return_exceptions=True)
    return outcomes


async def idle_ttft(url: str, model: str, count: int = 15) -> list[float]:
    """TTFT (s) of ``count`` sequential one-token requests on an idle deployment, prompts
    shorter than a KV page so nothing is cached: what the proxy alone adds."""
    out: list[float] = []
    connector = aiohttp.TCPConnector(force_close=True, limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=30)) as session:
        for i in range(count):
            request = Request(i, Endpoint.COMPLETIONS, 1, 0.0, prompt=f" probe {i}")
            outcome = Outcome(i, "", 0.0, time.perf_counter())

            def clock() -> float:
                return time.perf_counter()

            await _send(session, url, model, request, outcome, clock)
            if outcome.ok and outcome.ttft_s is not None:
                out.append(outcome.ttft_s)
    return out
