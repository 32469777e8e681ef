"""Wedged-worker detection for attempts waiting on their first byte (issue 32).

A non-streamed answer's first byte is the whole answer, so ``response_timeout_s`` (was
300 s, now 600 s: it bounds a legitimate generation) was the only bound on it, and a worker
that stops generating while its health and load probes still answer kept requests that
long. This watch tells a wedge from a long generation by asking the engine itself,
through its inference path:

- every byte a worker sends (a stream's chunk, a whole answer) is *progress*;
- an attempt that has waited ``wedge_after_s`` for its first byte on a worker that made no
  progress for as long makes that worker a *suspect*: it gets a probe, a streamed
  one-token completion, which must produce its first event within
  ``wedge_probe_timeout_s``;
- a probe that answers is progress (a long generation goes on untouched); one that does not
  marks the worker *wedged*: every attempt waiting on it fails at once (a worker failure:
  counted, breaker, retried on the next worker — nothing was sent to the client yet).

So a wedged worker costs a waiting request about ``wedge_after_s`` + the probe timeout +
one check interval (defaults 4 + 8 + 1 s), not ``response_timeout_s``. The cost of a
false alarm (an engine whose queue holds the probe past its timeout while nothing else it
runs sends a byte) is a retry of the waiting attempts. ``wedge_after_s`` 0 turns the watch
off. Prefill/decode pairs are not watched: the probe is a plain completion, which a
prefill-only or decode-only engine cannot answer alone (an SGLang prefill waits for its
decode's bootstrap, a decode for the KV transfer; vLLM's need ``kv_transfer_params``), so
probing them would call every PD worker wedged. Their legs keep their own bounds
(``pd.prefill_timeout_s`` 60 s, ``pd.decode_timeout_s`` 300 s); a pair-aware probe is still
to be built.

:class:`ProgressWatch` is the bookkeeping (event-loop only, no I/O); :meth:`run` its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from cortex.gateway.fleet.pool import WorkerPool, WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.upstream.client import Upstream, UpstreamFailure

__all__ = ["ProgressWatch"]

log = logging.getLogger(__name__)

_CHECK_INTERVAL_S = 1.0


@dataclass(slots=True)
class _Worker:
    progress_at: float  # monotonic s of the worker's last byte (or answered probe)
    waiting: dict[int, tuple[float, Callable[[], None]]] = field(default_factory=dict)
    probing: bool = False


class ProgressWatch:
    """``wedge_after_s`` / ``probe_timeout_s`` in seconds (``wedge_after_s`` 0: off)."""

    def __init__(self, wedge_after_s: float, probe_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.wedge_after_s = wedge_after_s
        self.probe_timeout_s = probe_timeout_s
        self._clock = clock
        self._workers: dict[str, _Worker] = {}
        self._ids = itertools.count()
        self.wedged_total = 0

    def _entry(self, worker_id: str) -> _Worker:
        entry = self._workers.get(worker_id)
        if entry is None:
            entry = self._workers[worker_id] = _Worker(self._clock())
        return entry

    def progressed(self, worker_id: str) -> None:
        """``worker_id`` sent bytes now."""
        entry = self._workers.get(worker_id)
        if entry is not None:
            entry.progress_at = self._clock()

    @contextlib.contextmanager
    def waiting(self, worker_id: str, on_wedged: Callable[[], None]) -> Iterator[None]:
        """An attempt waits for its first byte from ``worker_id`` inside this block;
        ``on_wedged`` is called (once at most) if the worker is found wedged meanwhile."""
        if not self.wedge_after_s:
            yield
            return
        entry = self._entry(worker_id)
        key = next(self._ids)
        entry.waiting[key] = (self._clock(), on_wedged)
        try:
            yield
        finally:
            entry.waiting.pop(key, None)
            if not entry.waiting and not entry.probing and self._workers.get(worker_id) is entry:
                del self._workers[worker_id]  # quiet workers cost nothing

    def suspects(self) -> list[str]:
        """Workers to probe now: an attempt waited ``wedge_after_s`` on each, and each sent
        nothing for as long (and is not being probed already)."""
        now = self._clock()
        bound = now - self.wedge_after_s
        return [worker_id for worker_id, entry in self._workers.items()
                if not entry.probing and entry.progress_at <= bound
                and any(since <= bound for since, _ in entry.waiting.values())]

    def wedged(self, worker_id: str) -> int:
        """Fail every attempt waiting on ``worker_id``; how many there were."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return 0
        waiting, entry.waiting = entry.waiting, {}
        for _, on_wedged in waiting.values():
            on_wedged()
        self.wedged_total += 1
        return len(waiting)

    async def run(self, pool: WorkerPool, upstream: Upstream, metrics: GatewayMetrics) -> None:
        """Check for suspects every second and probe them, until cancelled."""
        if not self.wedge_after_s:
            return
        probes: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(_CHECK_INTERVAL_S)
                for worker_id in self.suspects():
                    worker = pool.get(worker_id)
                    if worker is None:
                        continue
                    self._workers[worker_id].probing = True
                    task = asyncio.create_task(self._probe(worker, upstream, metrics))
                    probes.add(task)
                    task.add_done_callback(probes.discard)
        finally:
            for task in probes:
                task.cancel()

    async def _probe(self, worker: WorkerState, upstream: Upstream,
                     metrics: GatewayMetrics) -> None:
        body = json.dumps({"model": worker.spec.model, "prompt": "ping", "max_tokens": 1,
                           "stream": True}).encode()
        answered = False
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await upstream.post(
                    worker.spec.url.rstrip("/") + "/v1/completions", body,
                    {"Content-Type": "application/json"}, worker.spec)
                try:
                    async for _ in response.chunks():
                        answered = True  # its first event: the engine generates
                        break
                finally:
                    response.close()
        except (TimeoutError, UpstreamFailure):
            pass
        entry = self._workers.get(worker.id)
        if entry is None:
            return
        entry.probing = False
        if answered:
            entry.progress_at = self._clock()
            return
        failed = self.wedged(worker.id)
        metrics.worker(metrics.upstream_wedged, worker.id).inc()
        log.warning("worker wedged: no first byte in %.1fs and no probe answer in %.1fs; "
                    "%d waiting attempts fail over worker=%s", self.wedge_after_s,
                    self.probe_timeout_s, failed, worker.id, extra={"worker": worker.id})
        if not entry.waiting and self._workers.get(worker.id) is entry:
            del self._workers[worker.id]

    def __repr__(self) -> str:
        return (f"ProgressWatch(watched={len(self._workers)}, wedge_after_s="
                f"{self.wedge_after_s}, wedged_total={self.wedged_total})")
