"""Where a request's time inside a running gateway goes, in wall time, request by request
summed: for when a benchmark's TTFT is behind a peer's and the question is which part of the
gateway's path holds it, under the benchmark's own load.

Put this directory on ``PYTHONPATH`` and name an output file in ``CORTEX_TTFTSPLIT_OUT``;
every process whose command line is ``cortex.edge.main gateway`` then times, per routed
request:

* ``accepted to its first bytes`` and ``first bytes to the handler``: a connection's first
  request, from the accept to its first bytes read (the server's set-up of the
  connection, and the client's own time between connecting and sending), then to the
  inference handler's start (parsing the head, the request's task, the app's own
  dispatch);
* ``before dispatch``: from the inference handler's start (the request's head is parsed,
  its body not yet read) to the dispatcher's first attempt: reading, parsing, routing;
* ``to the first answer byte``: the attempt until the worker's answer head (the worker's
  own time to first token, plus the hop);
* ``to the client``: from there until the first event is handed to the HTTP server;

and the wall time of the request path's main calls (the routing stages, the lazy walk, the
template render, the ledger and predicted-block matches), and the event loop's lateness (a
2 ms timer's delay: what any ready task waits for the loop). The sums go to the file, one
JSON line per process, when the gateway exits (a benchmark's normal stop); ``python
tools/ttftsplit/summary.py FILE`` prints the means. Run beside the client's own TTFT (the
routing benchmark's TTFT split table), the difference is what the connection, the HTTP
server and the client took::

    CORTEX_TTFTSPLIT_OUT=/tmp/split.jsonl PYTHONPATH=tools/ttftsplit \\
        .venv/bin/cortex bench routing --workloads agents --contenders cortex
    .venv/bin/python tools/ttftsplit/summary.py /tmp/split.jsonl

Each timed call costs ~1 µs, the loop timer ~500 wake-ups per second: compare numbers
within one run. Not imported by anything else; a measuring aid for docs/bench.
"""

from __future__ import annotations

import asyncio
import atexit
import builtins
import contextvars
import functools
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

CALLS = (  # (module, class or None, function, a coroutine function)
    ("cortex.gateway.api.inference", "InferenceHandler", "_read_and_route", True),
    ("cortex.gateway.routing.router", "Router", "route", True),
    ("cortex.gateway.routing.router", "Router", "_walk", False),
    ("cortex.gateway.routing.router", "Router", "_ledger", True),
    ("cortex.gateway.routing.router", "Router", "_decide", False),
    ("cortex.gateway.tokens.service", "Tokenization", "walk", False),
    ("cortex.gateway.tokens.prompt", "PromptTokenizer", "prompt", False),
    ("cortex.gateway.tokens.prompt", "PromptTokenizer", "plan_prompt", False),
    ("cortex.gateway.routing.placement", "PredictedBlocks", "match", False),
    ("cortex.ledger.replica", "LedgerReplica", "match", False),
    ("cortex.gateway.request.payload", "Admit", "__call__", False),
)
LOOP_TIMER_S = 0.002
LATE_BOUNDS_MS = (0.5, 1, 2, 5, 10)

sums: dict[str, list[float]] = {}  # name -> [count, seconds]


def _add(name: str, seconds: float) -> None:
    entry = sums.setdefault(name, [0, 0.0])
    entry[0] += 1
    entry[1] += seconds


def _timed(fn: Callable[..., Any], name: str, coroutine: bool) -> Callable[..., Any]:
    if coroutine:
        @functools.wraps(fn)
        async def timed_coroutine(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                _add(name, time.perf_counter() - start)
        return timed_coroutine

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _add(name, time.perf_counter() - start)
    return timed


async def _loop_lateness() -> None:
    while True:
        start = time.perf_counter()
        await asyncio.sleep(LOOP_TIMER_S)
        late = time.perf_counter() - start - LOOP_TIMER_S
        _add("loop lateness", late)
        for bound in LATE_BOUNDS_MS:
            if late * 1e3 > bound:
                _add(f"loop lateness over {bound:g} ms", late)


def _segments() -> None:
    """The segments of each request, stamped in context variables the request's task (and
    the dispatch it awaits inline) shares."""
    import cortex.gateway.api.inference as inference
    import cortex.gateway.dispatch.dispatcher as dispatcher
    import cortex.gateway.http.h1 as h1

    stamps: contextvars.ContextVar[dict[str, float] | None] = contextvars.ContextVar(
        "ttftsplit", default=None)
    lateness: list[asyncio.Task[None]] = []
    handle = inference.InferenceHandler.__call__
    made = h1.H1Connection.connection_made
    received = h1.H1Connection.data_received
    start = h1.H1Connection._start

    # a connection's accept time and its first bytes', handed to its first request's scope
    # (a later request on the same connection did not wait for an accept)
    def connected(self: Any, transport: Any) -> None:
        self.ttftsplit = [time.perf_counter()]
        made(self, transport)

    def read(self: Any, data: bytes) -> None:
        stamped = getattr(self, "ttftsplit", None)
        if stamped is not None and len(stamped) == 1:
            stamped.append(time.perf_counter())
        received(self, data)

    def started(self: Any, exchange: Any) -> None:
        stamped = getattr(self, "ttftsplit", None)
        if stamped is not None and len(stamped) == 2:
            exchange.scope["ttftsplit.connection"] = stamped
            self.ttftsplit = None
        start(self, exchange)

    async def handled(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        if not lateness:
            lateness.append(asyncio.ensure_future(_loop_lateness()))
        mine = {"start": time.perf_counter()}
        stamps.set(mine)
        if (at := request.scope.pop("ttftsplit.connection", None)) is not None:
            _add("connection: accepted to its first bytes", at[1] - at[0])
            _add("connection: first bytes to the handler", mine["start"] - at[1])
        try:
            return await handle(self, request, *args, **kwargs)
        finally:
            if {"open", "opened", "first"} <= mine.keys():
                _add("request: before dispatch", mine["open"] - mine["start"])
                _add("request: to the first answer byte", mine["opened"] - mine["open"])
                _add("request: to the client", mine["first"] - mine["opened"])

    open_ = dispatcher.Dispatcher.open

    async def opened(self: Any, *args: Any, **kwargs: Any) -> Any:
        mine = stamps.get()
        if mine is not None:
            mine["open"] = time.perf_counter()
        try:
            return await open_(self, *args, **kwargs)
        finally:
            if mine is not None:
                mine["opened"] = time.perf_counter()

    first_byte = inference._Conversation._first_byte_sent

    def first(self: Any, *args: Any, **kwargs: Any) -> Any:
        mine = stamps.get()
        if mine is not None and "first" not in mine:
            mine["first"] = time.perf_counter()
        return first_byte(self, *args, **kwargs)

    inference.InferenceHandler.__call__ = handled
    h1.H1Connection.connection_made = connected
    h1.H1Connection.data_received = read
    h1.H1Connection._start = started
    dispatcher.Dispatcher.open = opened
    inference._Conversation._first_byte_sent = first


def _install(out: str) -> None:
    for module, owner_name, name, coroutine in CALLS:
        owner = importlib.import_module(module)
        if owner_name is not None:
            owner = getattr(owner, owner_name)
        setattr(owner, name, _timed(getattr(owner, name), f"{owner_name}.{name}", coroutine))
    _segments()

    def dump() -> None:
        with open(out, "a", encoding="utf-8") as f:
            f.write(json.dumps({"pid": os.getpid(), "sums": sums}) + "\n")

    atexit.register(dump)


def _when_imported(out: str) -> None:
    """Install once the gateway's server module is imported (everything timed is loaded
    then, nothing has run yet)."""
    original = builtins.__import__

    def importing(name: str, *args: Any, **kwargs: Any) -> Any:
        module = original(name, *args, **kwargs)
        if name == "cortex.gateway.server":
            builtins.__import__ = original
            _install(out)
        return module

    builtins.__import__ = importing


if "cortex.edge.main gateway" in " ".join(sys.orig_argv):
    if (target := os.environ.get("CORTEX_TTFTSPLIT_OUT")):
        _when_imported(target)
