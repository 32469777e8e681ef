"""The gateway's gRPC client of the index, for when its ledger replica cannot answer: Match
with deadlines, and ledger states — over grpclib, with failover between replicas and errors
translated here.

A failed or late Match never fails a request: it returns ``None`` and the router degrades
to load-only modes. After a failure the client skips the index for ``retry_after_ms`` so a
down index costs no timeout per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from types import TracebackType

from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from cortex.edge.tasks import stop_tasks
from cortex.gateway.config.gateway import IndexConfig
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import HashDomain
from cortex.ledger.client import IndexStub, index_channel, match_request
from cortex.ledger.codec import lenient_state, match_from_pb, pb
from cortex.ledger.match import Match
from cortex.ledger.model import LedgerState

__all__ = ["IndexClient"]

log = logging.getLogger(__name__)

_REJECTED = frozenset({Status.INVALID_ARGUMENT, Status.NOT_FOUND, Status.OUT_OF_RANGE})
_ERRORS = (GRPCError, StreamTerminatedError, ProtocolError, OSError, TimeoutError)


class IndexClient:
    """Use as ``async with IndexClient(config, metrics, on_ledgers, polling, token) as idx``.

    ``on_ledgers(states)`` gets each worker's best ledger state every ``workers_poll_s``
    while ``polling()`` says so (the replica, when usable, knows them itself).
    """

    def __init__(
        self,
        config: IndexConfig,
        metrics: GatewayMetrics,
        on_ledgers: Callable[[dict[str, LedgerState]], None],
        polling: Callable[[], bool] = lambda: True,
        token: str | None = None,
    ) -> None:
        self.config = config
        self._token = token
        self.metrics = metrics
        self._on_ledgers = on_ledgers
        self._polling = polling
        self._channels: list[Channel] = []
        self._current = 0
        self._down_until = 0.0
        self._task: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.config.targets)

    @property
    def available(self) -> bool:
        """Configured and not backing off after a failure."""
        return self.configured and time.monotonic() >= self._down_until

    async def __aenter__(self) -> IndexClient:
        self._channels = [index_channel(t) for t in self.config.targets]
        if self._channels:
            self._task = asyncio.create_task(self._workers_loop(), name="index-workers")
        self.metrics.index_available.set(1 if self.configured else 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_tasks([task])
        for channel in self._channels:
            channel.close()
        self._channels = []

    def _stub(self) -> IndexStub:
        return IndexStub(self._channels[self._current % len(self._channels)], token=self._token)

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
    ) -> Match | None:
        """Leading blocks of ``keys`` per source, or ``None`` when the index cannot answer
        in time. ``deadline``: the request's, in ``time.monotonic()`` seconds."""
        if not self.available or not keys:
            return None
        remaining = deadline - time.monotonic()
        timeout = min(self.config.match_timeout_ms / 1000.0, remaining)
        if timeout <= 0:
            return None
        request = match_request(domain.model, block_keys=keys, block_size=domain.block_size,
                                engine=domain.engine)
        try:
            reply = await self._stub().match(request, timeout=timeout)
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
        return match_from_pb(reply)

    async def _workers_loop(self) -> None:
        while True:
            if self._polling():
                with contextlib.suppress(*_ERRORS):
                    reply = await self._stub().workers(pb.WorkersRequest(), timeout=2.0)
                    states: dict[str, LedgerState] = {}
                    for info in reply.workers:
                        if info.source.tier:  # offload tiers only extend a device prefix
                            continue
                        worker = info.source.worker_id
                        if states.get(worker) is not LedgerState.READY:
                            states[worker] = lenient_state(info.state)
                    self._on_ledgers(states)
            await asyncio.sleep(self.config.workers_poll_s)

    def __repr__(self) -> str:
        return f"IndexClient(targets={self.config.targets}, available={self.available})"
