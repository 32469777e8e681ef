"""The in-process runner: ``async with SimServer(config) as sim:`` is one simulated worker.

It binds every listener its role needs (HTTP; per data-parallel rank a ZMQ PUB and a
replay ROUTER on consecutive ports; for a prefill the KV side channel and, for SGLang, the
bootstrap server); port 0 in the config binds a free port (a free run of ``dp_size``
ports) and the real ports are exposed as attributes. Leaving the block closes all of them,
also on cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from typing import Any

import aiohttp
import zmq
import zmq.asyncio
from aiohttp import web

from cortex.chat import ChatTokenizer
from cortex.sim.config import Role, SimConfig
from cortex.sim.engine import SimEngine
from cortex.sim.faults import FaultState
from cortex.sim.pd import BootstrapServer, KvTransferClient, KvTransferServer
from cortex.sim.publisher import EventEncoder, EventPublisher
from cortex.sim.routes import SimRoutes
from cortex.sim.sockets import site_port
from cortex.sim.textgen import TextGenerator

__all__ = ["SimServer", "load_chat_tokenizer"]

log = logging.getLogger(__name__)

_SHUTDOWN_GRACE_S = 0.5
_BIND_ATTEMPTS = 20  # tries to find dp_size consecutive free ports for "any port"


class _QuietProbes(logging.Filter):
    """Drop aiohttp's traceback for HTTP/2 prior-knowledge probes (``PRI * HTTP/2.0``).

    sglang-router probes every worker that way before falling back to HTTP/1.1; the
    engines answer 400 too, without a traceback in their logs.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (exc is not None and "PRI/Upgrade" in str(exc))


_QUIET_PROBES = _QuietProbes()


@functools.lru_cache(maxsize=8)
def load_chat_tokenizer(tokenizer: str | None, chat_template: str | None) -> ChatTokenizer:
    """Load (once per process) the tokenizer + chat template pair a sim serves with."""
    return ChatTokenizer.load(tokenizer, chat_template)


class SimServer:
    """One simulated SGLang / vLLM worker, bound on ``config.host``.

    After entering: ``url`` (HTTP base URL), ``port``, ``kv_events_port`` /
    ``kv_events_endpoint``, ``replay_port`` / ``replay_endpoint`` (``None`` without replay;
    rank 0's, rank r is on port + r), ``bootstrap_port`` (SGLang prefill),
    ``transfer_port`` (prefill side channel), ``engines`` (one per DP rank: cache, stats),
    ``engine`` (rank 0), ``faults`` (switch faults at run time), ``restart()``.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.faults = FaultState(config.faults, seed=config.seed)
        self.port = 0
        self.kv_events_port = 0
        self.replay_port: int | None = None
        self.bootstrap_port: int | None = None
        self.transfer_port: int | None = None
        self._ports: dict[str, int | None] = {}
        self._stack: contextlib.AsyncExitStack | None = None
        self._engines: list[SimEngine] = []
        self._routes: SimRoutes | None = None
        self._publishers: list[EventPublisher] = []

    # -- lifecycle ------------------------------------------------------------------------

    async def __aenter__(self) -> SimServer:
        server_log = logging.getLogger("aiohttp.server")
        if _QUIET_PROBES not in server_log.filters:
            server_log.addFilter(_QUIET_PROBES)
        stack = contextlib.AsyncExitStack()
        await stack.__aenter__()
        try:
            await self._start(stack)
        except BaseException:
            await stack.aclose()
            raise
        self._stack = stack
        log.info("sim ready: %r", self)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        stack, self._stack = self._stack, None
        if self._routes is not None:
            self._routes.shutting_down = True
        if stack is not None:
            await stack.aclose()

    async def _open_publishers(self, stack: contextlib.AsyncExitStack, ctx: zmq.asyncio.Context
                               ) -> list[EventPublisher]:
        """One PUB (+ replay) per DP rank on ``base + rank``; base 0 = a free run of ports."""
        cfg = self.config
        retry = cfg.dp_size > 1 and (cfg.kv_events_port == 0 or cfg.replay_port == 0)
        for attempt in range(_BIND_ATTEMPTS):
            inner = contextlib.AsyncExitStack()
            publishers: list[EventPublisher] = []
            pub_base, replay_base = cfg.kv_events_port, cfg.replay_port
            try:
                for rank in range(cfg.dp_size):
                    publisher = await inner.enter_async_context(EventPublisher(
                        ctx, EventEncoder(cfg.engine, cfg.engine_version, rank), self.faults,
                        host=cfg.host, pub_port=pub_base + rank if rank else pub_base,
                        replay_port=None if replay_base is None else (
                            replay_base + rank if rank else replay_base),
                        topic=cfg.topic, buffer_steps=cfg.buffer_steps))
                    if rank == 0:
                        pub_base, replay_base = publisher.pub_port, publisher.replay_port
                    publishers.append(publisher)
            except zmq.ZMQError:
                await inner.aclose()
                if not retry or attempt == _BIND_ATTEMPTS - 1:
                    raise
                continue
            except BaseException:
                await inner.aclose()
                raise
            stack.push_async_callback(inner.aclose)
            return publishers
        raise AssertionError("unreachable")

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.config
        chat = await asyncio.to_thread(load_chat_tokenizer, cfg.tokenizer, cfg.chat_template)
        ctx = zmq.asyncio.Context()
        stack.callback(ctx.destroy, 0)

        self._publishers = await self._open_publishers(stack, ctx)
        self.kv_events_port = self._publishers[0].pub_port
        self.replay_port = self._publishers[0].replay_port

        transfer_server: KvTransferServer | None = None
        transfer_client: KvTransferClient | None = None
        if cfg.role is Role.PREFILL:
            transfer_server = await stack.enter_async_context(KvTransferServer(
                ctx, cfg.host, cfg.transfer_port, room_timeout_s=cfg.bootstrap_timeout_s))
            self.transfer_port = transfer_server.port
        elif cfg.role is Role.DECODE:
            session = await stack.enter_async_context(aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=cfg.transfer_timeout_s)))
            transfer_client = KvTransferClient(ctx, session)

        textgen = TextGenerator(chat.tokenizer, seed=cfg.seed, natural_tokens=cfg.output_tokens,
                                eos_token_id=chat.eos_token_id)
        self._engines = [
            SimEngine(cfg, chat, publisher=publisher, transfer_server=transfer_server,
                      transfer_client=transfer_client, transfer_port=self.transfer_port or 0,
                      dp_rank=rank, textgen=textgen)
            for rank, publisher in enumerate(self._publishers)
        ]
        self._ports = {"http": None, "kv_events": self.kv_events_port,
                       "replay": self.replay_port, "transfer": self.transfer_port}
        self._routes = SimRoutes(cfg, self._engines, self.faults, self._ports, self.restart)
        self._routes.notify_faults_changed()  # faults armed at start-up (max_running)
        runner = web.AppRunner(self._routes.build(), access_log=None, handle_signals=False,
                               handler_cancellation=True, shutdown_timeout=_SHUTDOWN_GRACE_S)
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, cfg.host, cfg.port)
        await site.start()
        self.port = site_port(runner)
        self._ports["http"] = self.port
        engine_id = cfg.engine_id or f"cortex-sim-{cfg.public_host}-{self.port}"
        for engine in self._engines:
            # vLLM suffixes the KV connector's engine id with the DP rank
            engine.engine_id = engine_id if cfg.dp_size == 1 else f"{engine_id}_dp{engine.dp_rank}"
        # Stop answering before the listeners behind the handlers go away.
        stack.callback(self._mark_shutting_down)

        if cfg.runs_bootstrap_server:
            bootstrap = await stack.enter_async_context(BootstrapServer(
                cfg.host, 8998 if cfg.bootstrap_port is None else cfg.bootstrap_port,
                rank_ip=cfg.public_host, rank_port=self.transfer_port or 0,
                page_size=cfg.block_size, http_port=self.port, dp_size=cfg.dp_size))
            self.bootstrap_port = bootstrap.port
            self._ports["bootstrap"] = self.bootstrap_port
        for engine in self._engines:
            engine.announce_start()

    def _mark_shutting_down(self) -> None:
        if self._routes is not None:
            self._routes.shutting_down = True

    # -- API for tests, benchmarks and the launcher ---------------------------------------

    @property
    def engines(self) -> tuple[SimEngine, ...]:
        """One engine per data-parallel rank."""
        if not self._engines:
            raise RuntimeError("the sim is not running")
        return tuple(self._engines)

    @property
    def engine(self) -> SimEngine:
        """Rank 0's engine (the only one unless ``dp_size`` > 1)."""
        return self.engines[0]

    @property
    def publisher(self) -> EventPublisher:
        """Rank 0's event publisher."""
        if not self._publishers:
            raise RuntimeError("the sim is not running")
        return self._publishers[0]

    @property
    def host(self) -> str:
        return self.config.public_host

    @property
    def url(self) -> str:
        """HTTP base URL, e.g. ``http://127.0.0.1:41234`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """Where a SUB connects, e.g. ``tcp://127.0.0.1:41235``."""
        return f"tcp://{self.host}:{self.kv_events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        """Where a replay DEALER connects (``None`` without replay)."""
        return None if self.replay_port is None else f"tcp://{self.host}:{self.replay_port}"

    def kv_events_endpoint_of(self, rank: int) -> str:
        """DP rank ``rank``'s PUB endpoint (``kv_events_port + rank``)."""
        return f"tcp://{self.host}:{self.kv_events_port + rank}"

    def replay_endpoint_of(self, rank: int) -> str | None:
        """DP rank ``rank``'s replay endpoint (``replay_port + rank``)."""
        if self.replay_port is None:
            return None
        return f"tcp://{self.host}:{self.replay_port + rank}"

    def set_faults(self, **fields: Any) -> None:
        """Arm or change faults (fields of :class:`~cortex.sim.config.FaultConfig`)."""
        self.faults.update(fields)
        if self._routes is not None:
            self._routes.notify_faults_changed()

    def clear_faults(self) -> None:
        self.faults.clear()
        if self._routes is not None:
            self._routes.notify_faults_changed()

    def restart(self) -> None:
        """Fault: act as a restarted engine (event seq from 0, cache emptied, AllBlocksCleared)."""
        for engine in self.engines:
            engine.restart()

    def worker_spec(self, worker_id: str | None = None) -> dict[str, Any]:
        """This worker as a Cortex registry entry (architecture §2)."""
        cfg = self.config
        return {
            "id": worker_id or f"{cfg.engine.value}-{cfg.role.value}-{self.host}-{self.port}",
            "url": self.url,
            "engine": cfg.engine.value,
            "role": cfg.role.value,
            "model": cfg.model,
            "dp_size": cfg.dp_size,
            "kv_events_endpoint": self.kv_events_endpoint,
            "kv_events_topic": cfg.topic,
            "replay_endpoint": self.replay_endpoint,
            "bootstrap_port": self.bootstrap_port,
            "block_size": cfg.block_size,
            "labels": {"sim": "true"},
        }

    def __repr__(self) -> str:
        cfg = self.config
        return (f"SimServer({cfg.engine.value} {cfg.engine_version} {cfg.role.value}, "
                f"url={self.url}, dp_size={cfg.dp_size}, kv_events={self.kv_events_port}, "
                f"replay={self.replay_port}, bootstrap={self.bootstrap_port}, "
                f"transfer={self.transfer_port})")
