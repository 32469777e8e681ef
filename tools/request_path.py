"""Which modules one gateway request passes through: a layout measurement, not a benchmark.

``python tools/request_path.py`` starts, in this process, a zero-cost sim, an index and a
gateway (all on 127.0.0.1, port 0), warms them with one request, then traces one regular and
one streamed chat request with :func:`sys.setprofile`. Only the gateway's request tasks are
traced: the ASGI app is wrapped so that a context variable marks every task the request
starts (background work — probes, load polls, the replica stream — and the sim are not).

For each request it prints, over the ``cortex.*`` modules of the gateway process:

* ``modules``: distinct modules whose code ran (``gateway``: those under ``cortex.gateway``);
* ``moves``: calls (and coroutine resumptions) whose caller is in another module;
* the modules entered most often, and how often the module of ``Router`` was entered.

The numbers depend on the layout, not on timing: run it on two trees to compare them
(``PYTHONPATH=<tree>/services/gateway:... python tools/request_path.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import json
import sys
from collections import Counter
from collections.abc import AsyncIterator
from types import FrameType
from typing import Any

import aiohttp

from cortex.gateway import GatewayConfig, IndexConfig, ModelConfig, ServerConfig
from cortex.gateway.server import GatewayServer
from cortex.index.config import IndexConfig as IndexServerConfig
from cortex.index.server import IndexServer
from cortex.registry import WorkerSpec
from cortex.sim.config import SimConfig, TimingConfig
from cortex.sim.server import SimServer

MODEL = "cortex-sim"
BLOCK = 16
OUTSIDE = ("cortex.sim", "cortex.index", "cortex.ingest", "cortex.testing", "cortex.bench")
ON_REQUEST: contextvars.ContextVar[bool] = contextvars.ContextVar("on_request", default=False)


class Tagged:
    """The gateway's ASGI app, with every HTTP request (and each task it starts) marked."""

    def __init__(self, app: Any) -> None:
        self._app = app

    def __getattr__(self, name: str) -> Any:
        return getattr(self._app, name)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            ON_REQUEST.set(True)
        await self._app(scope, receive, send)


class Trace:
    """Module entries of the marked tasks, from ``sys.setprofile`` call events."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.modules: set[str] = set()

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not ON_REQUEST.get():
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("cortex.") or module.startswith(OUTSIDE):
            return
        self.modules.add(module)
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if caller != module:
            self.entries[module] += 1


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[str]:
    """A sim, an index and a gateway matching on its replica; yields the gateway's URL."""
    async with contextlib.AsyncExitStack() as stack:
        sim = await stack.enter_async_context(SimServer(SimConfig(
            port=0, kv_events_port=0, replay_port=0, block_size=BLOCK, model=MODEL,
            timing=TimingConfig(zero_cost=True))))
        index = await stack.enter_async_context(IndexServer(IndexServerConfig(
            host="127.0.0.1", port=0, metrics_port=None)))
        spec = WorkerSpec(id="w0", url=sim.url, engine=sim.config.engine, model=MODEL,
                          kv_events=sim.kv_events_endpoint, replay=sim.replay_endpoint,
                          block_size=BLOCK)
        config = GatewayConfig(models=(ModelConfig(name=MODEL, block_size=BLOCK),),
                               server=ServerConfig(host="127.0.0.1", port=0),
                               index=IndexConfig(targets=(index.target,)), workers=(spec,))
        server = GatewayServer(config)
        server.app = Tagged(server.app)  # type: ignore[assignment]
        await stack.enter_async_context(server)
        yield server.url


def body(stream: bool, turn: int) -> dict[str, Any]:
    system = "You are a careful assistant. " * 60
    return {"model": MODEL, "stream": stream, "max_tokens": 4,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": f"question number {turn}"}]}


async def one(http: aiohttp.ClientSession, url: str, stream: bool, turn: int) -> None:
    async with http.post(f"{url}/v1/chat/completions", json=body(stream, turn)) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def measure() -> dict[str, Any]:
    router_module = _router_module()
    out: dict[str, Any] = {}
    async with cluster() as url, aiohttp.ClientSession() as http:
        for turn in range(3):  # warm: tokenizer, segment cache, ledger, connections
            await one(http, url, False, turn)
            await one(http, url, True, turn)
        for name, stream in (("regular", False), ("streamed", True)):
            trace = Trace()
            sys.setprofile(trace)
            try:
                await one(http, url, stream, 100)
            finally:
                sys.setprofile(None)
            out[name] = {
                "modules": len(trace.modules),
                "gateway_modules": sum(m.startswith("cortex.gateway") for m in trace.modules),
                "moves": sum(trace.entries.values()),
                "router_entries": trace.entries[router_module],
                "most_entered": trace.entries.most_common(8),
                "module_list": sorted(trace.modules),
            }
    return out


def _router_module() -> str:
    for candidate in ("cortex.gateway.routing.router", "cortex.gateway.routing.router"):
        with contextlib.suppress(ImportError):
            return __import__(candidate, fromlist=["Router"]).Router.__module__  # type: ignore[no-any-return]
    raise SystemExit("no Router in this gateway")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.add_argument("--modules", action="store_true", help="list the modules entered")
    args = parser.parse_args(argv)
    result = asyncio.run(measure())
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for name, r in result.items():
        print(f"{name}: {r['modules']} modules ({r['gateway_modules']} gateway), "
              f"{r['moves']} moves, router entered {r['router_entries']}x")
        print("  most entered: " + ", ".join(f"{m} {n}" for m, n in r["most_entered"]))
        if args.modules:
            print("  " + "\n  ".join(r["module_list"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
