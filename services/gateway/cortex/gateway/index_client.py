"""The gateway's client of the index service: Match with deadlines, the change feed, ledger
states — over grpclib, with failover between replicas and errors translated here.

A failed or late Match never fails a request: it returns ``None`` and the router degrades
to load-only modes. After a failure the client skips the index for ``retry_after_ms`` so a
down index costs no timeout per request; the change-feed loop reconnects in the background
and clears the back-off as soon as a replica answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType

import grpclib.client
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from cortex.api.index import v1 as pb
from cortex.gateway.config import IndexConfig
from cortex.gateway.matching import LedgerState, MatchAnswer, SourceMatch
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import Engine, HashDomain
from cortex.index.wire import WireError, call_match, encode_match_request

__all__ = ["IndexClient", "ledger_state"]

log = logging.getLogger(__name__)

_ENGINE_KIND = {Engine.SGLANG: 1, Engine.VLLM: 2}
_STATES = {
    1: LedgerState.SYNCING,
    2: LedgerState.READY,
    3: LedgerState.STALE,
    4: LedgerState.REMOVED,
    5: LedgerState.MISALIGNED,
}
_REJECTED = frozenset({Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.OUT_OF_RANGE})
_ERRORS = (GRPCError, StreamTerminatedError, ProtocolError, OSError, TimeoutError, WireError)


def ledger_state(value: int) -> LedgerState:
    """``cortex.index.v1.LedgerState`` value → :class:`LedgerState`."""
    return _STATES.get(int(value), LedgerState.UNKNOWN)


def _parse_target(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


class IndexClient:
    """Use as ``async with IndexClient(config, metrics, on_changes, on_feed_lost) as idx``.

    ``on_changes(batch)`` receives every ``ChangeBatch``; ``on_feed_lost()`` is called when
    the feed breaks (cached answers can no longer be trusted). ``on_ledgers(states)`` gets
    each worker's best ledger state every ``workers_poll_s``.
    """

    def __init__(
        self,
        config: IndexConfig,
        metrics: GatewayMetrics,
        on_changes: Callable[[pb.ChangeBatch], None],
        on_feed_lost: Callable[[], None],
        on_ledgers: Callable[[dict[str, LedgerState]], None],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._on_changes = on_changes
        self._on_feed_lost = on_feed_lost
        self._on_ledgers = on_ledgers
        self._targets = [_parse_target(t) for t in config.targets]
        self._channels: list[grpclib.client.Channel] = []
        self._current = 0
        self._down_until = 0.0
        self._tasks: list[asyncio.Task[None]] = []
        self.feed_connected = False
        self.last_error: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self._targets)

    @property
    def available(self) -> bool:
        """Configured and not backing off after a failure."""
        return self.configured and time.monotonic() >= self._down_until

    async def __aenter__(self) -> IndexClient:
        self._channels = [grpclib.client.Channel(host, port) for host, port in self._targets]
        if self._channels:
            self._tasks = [
                asyncio.create_task(self._feed_loop(), name="index-changes"),
                asyncio.create_task(self._workers_loop(), name="index-workers"),
            ]
        self.metrics.index_available.set(1 if self.configured else 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for channel in self._channels:
            channel.close()
        self._channels = []

    def _channel(self) -> grpclib.client.Channel:
        return self._channels[self._current % len(self._channels)]

    def _failed(self, kind: str, exc: BaseException) -> None:
        self.metrics.index_errors.labels(kind=kind).inc()
        if self.available:
            log.warning("index unavailable (%s): %r; serving with load-only routing", kind, exc)
        self.last_error = f"{kind}: {type(exc).__name__}"
        self._down_until = time.monotonic() + self.config.retry_after_ms / 1000.0
        self._current += 1  # fail over to the next replica
        self.metrics.index_available.set(0)

    def _recovered(self) -> None:
        if self._down_until:
            log.info("index reachable again")
        self._down_until = 0.0
        self.last_error = None
        self.metrics.index_available.set(1)

    async def match(
        self, domain: HashDomain, keys: list[int], deadline: float
    ) -> MatchAnswer | None:
        """Leading blocks of ``keys`` per source, or ``None`` when the index cannot answer
        in time. ``deadline``: the request's, in ``time.monotonic()`` seconds."""
        if not self.available or not keys:
            return None
        remaining = deadline - time.monotonic()
        timeout = min(self.config.match_timeout_ms / 1000.0, remaining)
        if timeout <= 0:
            return None
        request = encode_match_request(
            domain.model,
            block_keys=keys,
            block_size=domain.block_size,
            engine=_ENGINE_KIND[domain.engine],
        )
        try:
            reply = await call_match(self._channel(), request, timeout=timeout)
        except GRPCError as exc:
            if exc.status in _REJECTED:
                # this query only (e.g. over the index's size limits): the index is fine
                self.metrics.index_errors.labels(kind="rejected").inc()
                return None
            self._failed("match", exc)
            return None
        except _ERRORS as exc:
            if timeout < remaining or not isinstance(exc, TimeoutError):
                self._failed("match", exc)
            return None
        if self._down_until:
            self._recovered()
        sources = tuple(
            SourceMatch(hit.worker_id, hit.dp_rank, hit.matched_blocks, ledger_state(hit.state))
            for hit in reply.matches
        )
        return MatchAnswer(sources, reply.index_version, reply.query_blocks)

    async def _feed_loop(self) -> None:
        backoff = 0.05
        while True:
            try:
                async with self._channel().request(
                    "/cortex.index.v1.Index/Changes",
                    Cardinality.UNARY_STREAM,
                    pb.ChangesRequest,
                    pb.ChangeBatch,
                ) as stream:
                    await stream.send_message(pb.ChangesRequest(), end=True)
                    self.feed_connected = True
                    self._recovered()
                    backoff = 0.05
                    async for batch in stream:
                        self.metrics.change_batches.inc()
                        self._on_changes(batch)
            except _ERRORS as exc:
                if self.feed_connected:
                    log.warning("index change feed lost: %r", exc)
                self._failed("changes", exc)
            finally:
                if self.feed_connected:
                    self.feed_connected = False
                    self._on_feed_lost()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _workers_loop(self) -> None:
        while True:
            with contextlib.suppress(*_ERRORS):
                stub = pb.IndexStub(self._channel())
                reply = await stub.workers(pb.WorkersRequest(), timeout=2.0)
                states: dict[str, LedgerState] = {}
                for info in reply.workers:
                    state = ledger_state(info.state)
                    worker = info.source.worker_id
                    if states.get(worker) is not LedgerState.READY:
                        states[worker] = state
                self._on_ledgers(states)
            await asyncio.sleep(self.config.workers_poll_s)

    def __repr__(self) -> str:
        return (
            f"IndexClient(targets={self.config.targets}, available={self.available},"
            f" feed={self.feed_connected})"
        )
