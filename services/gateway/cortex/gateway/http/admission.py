"""Admission control: a concurrency limit with a bounded FIFO queue (sglang-router's
``--max-concurrent-requests`` / ``--queue-size`` / ``--queue-timeout-secs``).

At most ``max_concurrent`` inference requests are in service in this process; up to
``queue_size`` more wait, first come first served, at most ``queue_timeout_s`` seconds. A
request finding the queue full is refused at once (429 ``queue_full``), one that waited too
long gets 503 ``queue_timeout``; both carry ``Retry-After``. Waiting happens before the body
is read, so the memory of queued requests stays in the sockets.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

from cortex.gateway.config.gateway import AdmissionConfig
from cortex.gateway.errors import ErrorCode, ServiceUnavailable

__all__ = ["Admission"]


class Admission:
    """The limit and its queue (event-loop only). ``max_concurrent_requests`` 0 = none."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.active = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; raises :class:`ServiceUnavailable`
        (429 queue full, 503 waited too long). Every success needs one :meth:`release`."""
        cfg = self.config
        if not cfg.max_concurrent_requests or (
                self.active < cfg.max_concurrent_requests and not self._waiters):
            self.active += 1
            return
        if len(self._waiters) >= cfg.queue_size:
            raise ServiceUnavailable("the gateway is at its concurrency limit and its queue is "
                                     "full", code=ErrorCode.QUEUE_FULL, status=429,
                                     retry_after_s=cfg.retry_after_s)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(cfg.queue_timeout_s):
                await waiter
        except BaseException as exc:
            granted = waiter.done() and not waiter.cancelled()
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)
            if granted:  # the slot arrived as the wait ended: pass it on
                self.release()
            if isinstance(exc, TimeoutError):
                raise ServiceUnavailable(
                    f"no capacity within {cfg.queue_timeout_s:g}s", code=ErrorCode.QUEUE_TIMEOUT,
                    status=503, retry_after_s=cfg.retry_after_s) from None
            raise

    def release(self) -> None:
        """Hand the slot to the first live waiter, else free it."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.active -= 1

    def __repr__(self) -> str:
        return (f"Admission(active={self.active}, waiting={self.waiting}, "
                f"limit={self.config.max_concurrent_requests})")
