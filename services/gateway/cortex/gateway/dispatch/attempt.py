"""One attempt of a regular request on one worker, up to its first byte: the only await of
single-worker dispatch (:mod:`cortex.gateway.dispatch.dispatcher` decides which worker and what a
failure means, :mod:`cortex.gateway.dispatch.plan`).

An attempt holds an in-flight slot on its worker from the send until :meth:`Opened.close`
(the response stream ended), and counts its uncached prompt tokens on the worker's prefill
queue until the first byte. The worker's breaker gets a verdict for every attempt: success
once it answered, failure on a connection error, timeout, retryable status or a stream that
ends before its first chunk, and none (abandoned) when the attempt was cancelled or a worker
answered 429 (busy, not broken).

The wedge watch (the end of this module). A non-streamed answer's first byte is the whole
answer, so ``response_timeout_s`` (600 s: it bounds a legitimate generation) would be the only
bound on it, and a worker that stops generating while its health checks still pass would keep
requests that long. This watch tells a wedge from a long generation or a long queue by asking
the engine, first through a signal that never queues, then through its inference path:

- *progress* is any of: a byte the worker sent (a stream's first chunk, a whole answer); a
  load poll whose work mark (:data:`cortex.registry.engines.WorkMark`: vLLM's prompt and
  generation token counters, SGLang's KV tokens in use and running requests) differs from
  the poll before — the engine computed something, for whomever, so a saturated worker with
  a queue longer than ``wedge_after_s`` is busy, not wedged; an answered probe;
- an attempt that has waited ``wedge_after_s`` on a worker that made no progress for as long
  (counters flat, or load polls unanswered) makes it a *suspect*. A regular worker then gets
  a probe, a streamed one-token completion, which must produce its first event within
  ``wedge_probe_timeout_s``; a probe that answers, or counters that moved while it waited
  (the probe queued behind real work), clear the worker, anything else marks it *wedged*:
  every attempt waiting on it fails at once (a worker failure: counted, breaker, retried on
  the next worker — nothing was sent to the client yet);
- a prefill or decode leg cannot be probed (a PD engine does not answer a lone completion:
  an SGLang prefill waits for its decode's bootstrap, a decode for the KV transfer, vLLM's
  need ``kv_transfer_params``), so the engine's work mark alone decides: a leg whose worker
  and partner (the other leg's worker, which it may be waiting on) both made no progress for
  ``wedge_after_s`` + ``wedge_probe_timeout_s`` fails as wedged.

So a wedged worker costs a waiting request about ``wedge_after_s`` + the probe timeout + one
check interval (defaults 4 + 8 + 1 s), not ``response_timeout_s``; a busy one costs nothing.
What can still be taken for a wedge: an engine whose counters stay flat while it computes
— one prefill longer than the window with nothing else running (vLLM counts a prompt at its
first token), or SGLang with its KV pool pinned full — and then only if the probe (or, for a
PD leg, the partner) does not answer either. ``wedge_after_s`` 0 turns the watch off.

:class:`ProgressWatch` is the bookkeeping (event-loop only, no I/O); :meth:`ProgressWatch.run`
its loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cortex.gateway.fleet.pool import WorkerPool, WorkerState
from cortex.gateway.http.messages import json_dumps, json_loads
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import Decision, PDOutcome
from cortex.gateway.upstream.client import FailureKind, Response, Upstream, UpstreamFailure
from cortex.gateway.upstream.sse import EventRewrite, is_event_stream

__all__ = ["Checked", "Opened", "ProgressWatch", "WorkedAt", "acquire_slot", "attempt",
           "first_bytes", "release_slot"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Opened:
    """A worker answered: its response, the body bytes already read (the first chunk(s) of
    a stream, or the whole body otherwise) and the in-flight slot to release.

    ``hit_tokens``: prompt tokens predicted cached where the prompt was computed (the
    prefill worker of a pair). ``decision``: the ranking ``worker`` came from (``None``: the
    request's main decision). ``pd``: how a disaggregated model's request was served.
    ``rewrite``: applied to the answer's objects while streaming (PD usage / logprobs).
    ``on_close``: more cleanup (a pair's prefill leg still draining). ``answer``: the
    non-streamed 200 answer's JSON object, checked before the first byte (``None``
    otherwise).
    """

    worker: WorkerState
    response: Response
    head: bytes
    attempts: int
    _metrics: GatewayMetrics = field(repr=False)
    _slot: int = field(repr=False)
    hit_tokens: int = 0
    decision: Decision | None = None
    pd: PDOutcome | None = None
    rewrite: EventRewrite | None = field(default=None, repr=False)
    on_close: Callable[[], None] | None = field(default=None, repr=False)
    answer: Any = field(default=None, repr=False)
    _closed: bool = field(default=False, repr=False)

    def close(self) -> None:
        """Release the connection and the worker's in-flight slot (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.response.close()
        release_slot(self.worker, self._metrics, self._slot)
        if self.on_close is not None:
            self.on_close()


def acquire_slot(worker: WorkerState, metrics: GatewayMetrics) -> int:
    """Count one more request open on ``worker``; returns the slot for :func:`release_slot`."""
    slot = worker.open_request()
    metrics.worker(metrics.worker_inflight, worker.id).set(worker.inflight)
    return slot


def release_slot(worker: WorkerState, metrics: GatewayMetrics, slot: int) -> None:
    """A request open on ``worker`` (``slot``: what :func:`acquire_slot` returned) ended."""
    worker.close_request(slot)
    metrics.worker(metrics.worker_inflight, worker.id).set(worker.inflight)


async def attempt(upstream: Upstream, metrics: GatewayMetrics, worker: WorkerState, *,
                  path: str, body: bytes, headers: Mapping[str, str], stream: bool,
                  attempts: int, mode: str, prefill_tokens: int, first_byte_s: float,
                  retry_statuses: Collection[int], watch: ProgressWatch | None = None
                  ) -> Opened | UpstreamFailure:
    """One attempt up to its first byte, within ``first_byte_s`` seconds; ``prefill_tokens``
    count on the worker's prefill queue (:attr:`WorkerState.prefilling`) until then.
    ``attempts``: its number among the request's attempts; ``mode``: the decision's (the
    first-byte histogram's label). ``watch``: fails the wait at once when it finds the
    worker wedged (:mod:`cortex.gateway.dispatch.attempt`)."""
    breaker = worker.breaker
    breaker.on_attempt()
    slot = acquire_slot(worker, metrics)
    worker.queue_prefill(prefill_tokens)
    response: Response | None = None
    sent = time.perf_counter()
    timer = asyncio.timeout(first_byte_s)
    stall = asyncio.timeout(None)  # expires when the watch finds the worker wedged
    waiting = (watch.waiting(worker.id, lambda: stall.reschedule(-1.0))
               if watch is not None else contextlib.nullcontext())
    try:
        try:
            with waiting:
                async with timer, stall:
                    response = await upstream.post(worker.spec.url.rstrip("/") + path, body,
                                                   headers, worker.spec)
                    head, answer = await first_bytes(response, stream, retry_statuses,
                                                     listed=path == "/generate")
        except TimeoutError:
            if stall.expired():
                raise UpstreamFailure(FailureKind.WEDGED,
                                      "no progress and no probe answer") from None
            if not timer.expired():
                raise
            raise UpstreamFailure(FailureKind.TIMEOUT,
                                  f"no first byte in {first_byte_s}s") from None
    except UpstreamFailure as failure:
        if response is not None:
            response.close()
        release_slot(worker, metrics, slot)
        metrics.worker(metrics.upstream_errors, worker.id, failure.kind.value).inc()
        if failure.status == 429 or failure.kind is FailureKind.TOO_LARGE:
            breaker.on_abandon()  # busy, or asked for more than the gateway relays: not broken
        else:
            breaker.on_failure()
        return failure
    except BaseException:
        # cancelled (client gone, deadline) or a bug: no verdict on the worker
        if response is not None:
            response.close()
        release_slot(worker, metrics, slot)
        breaker.on_abandon()
        raise
    finally:
        worker.prefill_started(prefill_tokens)
    breaker.on_success()
    if watch is not None:
        watch.progressed(worker.id)
    if response.status == 200:
        metrics.worker(metrics.upstream_ttfb, worker.id, mode).observe(
            time.perf_counter() - sent)
    return Opened(worker, response, head, attempts, metrics, slot, answer=answer)


async def first_bytes(response: Response, stream: bool, retry_statuses: Collection[int],
                      *, listed: bool = False) -> tuple[bytes, Any]:
    """The whole body (and, for a 200, the JSON object it must be — or with ``listed``, a
    batched SGLang ``/generate``, a list of them), or a stream's first chunk (and
    ``None``); :class:`UpstreamFailure` for a retryable status, a stream that ends before
    any byte, or a 200 that breaks the endpoint's promise (``bad_answer``: a body that is
    not such JSON, a streamed request answered otherwise than with the engines' SSE)."""
    if response.status in retry_statuses:
        await response.read()
        raise UpstreamFailure(FailureKind.STATUS, f"status {response.status}",
                              response.status, response.retry_after_s)
    if response.status != 200:
        return await response.read(), None
    if not stream:
        body = await response.read()
        answer = json_answer(body, listed)
        if answer is None:
            raise UpstreamFailure(FailureKind.BAD_ANSWER, "a 200 that is not a JSON object")
        return body, answer
    if not response.content_type.startswith("text/event-stream"):
        raise UpstreamFailure(FailureKind.BAD_ANSWER,
                              f"a {response.content_type!r} answer to a streamed request")
    async with contextlib.aclosing(response.chunks()) as chunks:
        async for chunk in chunks:
            if not is_event_stream(chunk):
                raise UpstreamFailure(FailureKind.BAD_ANSWER, "a stream that is not SSE")
            return chunk, None
    raise UpstreamFailure(FailureKind.DISCONNECT, "stream ended before any byte")


def json_answer(body: bytes, listed: bool = False) -> Any:
    """``body`` as a JSON object (or, ``listed``, a non-empty list of them: a batched
    ``/generate``); ``None`` when it is not."""
    try:
        obj = json_loads(body)
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) or (listed and isinstance(obj, list) and obj
                                 and all(isinstance(item, dict) for item in obj)):
        return obj
    return None


# ---- the wedge watch ----


_CHECK_INTERVAL_S = 1.0

WorkedAt = Callable[[str], float | None]
"""Worker id → monotonic s of its engine's last observed work (a load poll whose work mark
changed), ``None`` when none was seen. The same shape says when the worker's latest load poll
that ended (answered or failed) was sent: :data:`PolledAt`."""

PolledAt = WorkedAt


def _never(_: str) -> float | None:
    return None


@dataclass(slots=True)
class _Waiter:
    since: float  # monotonic s the attempt began waiting
    on_wedged: Callable[[], None]
    probe: bool  # False: a PD leg, judged by the engines' work alone
    partner: str | None  # the other leg's worker, whose progress counts too


@dataclass(slots=True)
class _Worker:
    progress_at: float  # monotonic s of the worker's last byte (or answered probe)
    waiting: dict[int, _Waiter] = field(default_factory=dict)
    probing: float | None = None  # monotonic s the running probe began


@dataclass(frozen=True, slots=True)
class Checked:
    """One check's verdicts: workers to ``probe``, and PD legs found wedged (``wedged``:
    worker id → attempts failed)."""

    probe: list[str]
    wedged: dict[str, int]


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
        self.cleared_busy = 0  # suspects cleared because their engine was working

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
    def waiting(self, worker_id: str, on_wedged: Callable[[], None], *, probe: bool = True,
                partner: str | None = None) -> Iterator[None]:
        """An attempt waits for its first byte from ``worker_id`` inside this block;
        ``on_wedged`` is called (once at most) if the worker is found wedged meanwhile.
        ``probe`` False: a PD leg (never probed); ``partner``: the pair's other worker, whose
        progress counts as this leg's."""
        if not self.wedge_after_s:
            yield
            return
        entry = self._entry(worker_id)
        key = next(self._ids)
        entry.waiting[key] = _Waiter(self._clock(), on_wedged, probe, partner)
        try:
            yield
        finally:
            entry.waiting.pop(key, None)
            self._drop_if_quiet(worker_id, entry)

    def _drop_if_quiet(self, worker_id: str, entry: _Worker) -> None:
        if not entry.waiting and entry.probing is None and self._workers.get(worker_id) is entry:
            del self._workers[worker_id]  # quiet workers cost nothing

    def _last_progress(self, worker_id: str, worked_at: WorkedAt) -> float:
        """Monotonic s of ``worker_id``'s last sign of progress (bytes or engine work)."""
        entry = self._workers.get(worker_id)
        signs = [entry.progress_at] if entry is not None else []
        worked = worked_at(worker_id)
        if worked is not None:
            signs.append(worked)
        return max(signs, default=float("-inf"))

    def check(self, worked_at: WorkedAt, polled_at: PolledAt = _never) -> Checked:
        """What to do now: the :meth:`suspects` to probe, and the PD legs failed here (see
        :meth:`fail_silent_legs`)."""
        return Checked(self.suspects(worked_at, polled_at), self.fail_silent_legs(worked_at))

    def suspects(self, worked_at: WorkedAt = _never, polled_at: PolledAt = _never) -> list[str]:
        """Regular workers to probe now: an attempt waited ``wedge_after_s`` on each, each
        made no progress for as long, and none is being probed already.

        The silence must have been *seen*: when the worker's load is polled (``polled_at``
        not ``None``), a poll sent ``wedge_after_s`` into the silence must have ended, so a
        gateway whose own loop stalled (every sign it holds old) waits for a fresh poll
        instead of probing an engine that kept working. Polls that stopped (a worker no
        longer polled) are not waited on past ``probe_timeout_s`` more."""
        now = self._clock()
        found = []
        for worker_id, entry in self._workers.items():
            if entry.probing is not None:
                continue
            last = self._last_progress(worker_id, worked_at)
            polled = polled_at(worker_id)
            for waiter in entry.waiting.values():
                quiet_since = max(waiter.since, last)
                if not waiter.probe or now - quiet_since < self.wedge_after_s:
                    continue
                if (polled is None or polled >= quiet_since + self.wedge_after_s
                        or now - polled >= self.wedge_after_s + self.probe_timeout_s):
                    found.append(worker_id)
                    break
        return found

    def fail_silent_legs(self, worked_at: WorkedAt) -> dict[str, int]:
        """Fail the PD legs whose worker and partner both made no progress for
        ``wedge_after_s`` + ``probe_timeout_s`` (nor since the leg began waiting);
        worker id → legs failed."""
        now = self._clock()
        window = self.wedge_after_s + self.probe_timeout_s
        wedged: dict[str, int] = {}
        for worker_id, entry in list(self._workers.items()):
            last = self._last_progress(worker_id, worked_at)
            silent = []
            for key, waiter in entry.waiting.items():
                if waiter.probe:
                    continue
                quiet_since = max(waiter.since, last)
                if waiter.partner is not None:
                    quiet_since = max(quiet_since,
                                      self._last_progress(waiter.partner, worked_at))
                if now - quiet_since >= window:
                    silent.append(key)
            if not silent:
                continue
            for key in silent:
                entry.waiting.pop(key).on_wedged()
            wedged[worker_id] = len(silent)
            self.wedged_total += 1
            self._drop_if_quiet(worker_id, entry)
        return wedged

    def probe_started(self, worker_id: str) -> None:
        self._entry(worker_id).probing = self._clock()

    def probe_ended(self, worker_id: str, answered: bool, worked_at: WorkedAt) -> int | None:
        """The probe of ``worker_id`` ended: ``answered`` (its first event came) or not.
        Returns how many attempts failed when the worker is found wedged (no answer, and no
        engine work since the probe began), ``None`` when it is not."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return None
        began, entry.probing = entry.probing, None
        try:
            if answered:
                entry.progress_at = self._clock()
                return None
            worked = worked_at(worker_id)
            if worked is not None and began is not None and worked >= began:
                self.cleared_busy += 1  # the probe queued behind real work
                return None
            return self.wedged(worker_id)
        finally:
            self._drop_if_quiet(worker_id, entry)

    def wedged(self, worker_id: str) -> int:
        """Fail every attempt waiting on ``worker_id``; how many there were."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return 0
        waiting, entry.waiting = entry.waiting, {}
        for waiter in waiting.values():
            waiter.on_wedged()
        self.wedged_total += 1
        return len(waiting)

    async def run(self, pool: WorkerPool, upstream: Upstream, metrics: GatewayMetrics) -> None:
        """Check every second: probe suspects, fail wedged PD legs; until cancelled."""
        if not self.wedge_after_s:
            return

        def worked_at(worker_id: str) -> float | None:
            worker = pool.get(worker_id)
            return worker.worked_at if worker is not None else None

        def polled_at(worker_id: str) -> float | None:
            worker = pool.get(worker_id)
            return worker.polled_at if worker is not None else None

        probes: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(_CHECK_INTERVAL_S)
                checked = self.check(worked_at, polled_at)
                for worker_id, failed in checked.wedged.items():
                    self._report(worker_id, failed, metrics, "no engine progress on either "
                                 "side of the pair")
                for worker_id in checked.probe:
                    worker = pool.get(worker_id)
                    if worker is None:
                        continue
                    self.probe_started(worker_id)
                    task = asyncio.create_task(self._probe(worker, upstream, metrics,
                                                           worked_at))
                    probes.add(task)
                    task.add_done_callback(probes.discard)
        finally:
            for task in probes:
                task.cancel()

    async def _probe(self, worker: WorkerState, upstream: Upstream, metrics: GatewayMetrics,
                     worked_at: WorkedAt) -> None:
        body = json_dumps({"model": worker.spec.model, "prompt": "ping", "max_tokens": 1,
                           "stream": True})
        answered = False
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                response = await upstream.post(
                    worker.spec.url.rstrip("/") + "/v1/completions", body,
                    {"Content-Type": "application/json"}, worker.spec)
                try:
                    async with contextlib.aclosing(response.chunks()) as chunks:
                        async for _ in chunks:
                            answered = True  # its first event: the engine generates
                            break
                finally:
                    response.close()
        except (TimeoutError, UpstreamFailure):
            pass
        failed = self.probe_ended(worker.id, answered, worked_at)
        if failed is not None:
            self._report(worker.id, failed, metrics,
                         f"no probe answer in {self.probe_timeout_s:.1f}s")

    def _report(self, worker_id: str, failed: int, metrics: GatewayMetrics, why: str) -> None:
        metrics.worker(metrics.upstream_wedged, worker_id).inc()
        log.warning("worker wedged: no first byte nor engine progress in %.1fs, %s; "
                    "%d waiting attempts fail over worker=%s", self.wedge_after_s, why,
                    failed, worker_id, extra={"worker": worker_id})

    def __repr__(self) -> str:
        return (f"ProgressWatch(watched={len(self._workers)}, wedge_after_s="
                f"{self.wedge_after_s}, wedged_total={self.wedged_total}, "
                f"cleared_busy={self.cleared_busy})")
