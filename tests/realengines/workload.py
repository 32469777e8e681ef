"""A random multi-turn chat workload, and every request's prediction against the engine.

Each request goes through the gateway; the gateway's prediction is its
``x-cortex-cache-hit-tokens`` header, the truth is the serving engine's
``usage.prompt_tokens_details.cached_tokens`` (for streams: the usage chunk). A prediction is
*exact* when they are equal and an *over-prediction* when it is larger (the gateway promised
a hit the engine did not have, the one error routing must never make).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from cortex.hashing import Engine
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    decode_batch,
)
from cortex.kvevents.frames import parse_pub
from cortex.testing import wait_until

__all__ = ["REPORT_ENV", "ChatWorkload", "EvictionWatch", "Outcome", "Removal", "Settle",
           "Settled", "Tally", "post", "report"]

BLOCK_TOKENS = 16

REPORT_ENV = "CORTEX_REALENGINE_REPORT"  # a JSON file the run's numbers are added to


def report(name: str, numbers: dict[str, object]) -> None:
    """Print the numbers (``pytest -s`` shows them); add them to ``$CORTEX_REALENGINE_REPORT``."""
    print(f"\n{name}: {json.dumps(numbers)}")
    path = os.environ.get(REPORT_ENV)
    if path:
        found = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        Path(path).write_text(json.dumps({**found, name: numbers}, indent=1) + "\n")


_WORDS = ["cache", "prefix", "worker", "block", "token", "ledger", "route", "replica", "stream",
          "event", "index", "lease", "budget", "engine", "decode", "prefill", "模型", "缓存",
          "über", "naïve", "42", "3.14", "(x)", "<tag>", "end."]


@dataclass(frozen=True, slots=True)
class Outcome:
    """One answered request (``predicted`` / ``cached`` in tokens)."""

    turn: int
    worker: str
    stream: bool
    prompt_tokens: int
    predicted: int
    cached: int
    attempts: int
    sent_at: float = 0.0  # time.time(): comparable with the engines' batch timestamps
    settled: Settled | None = None  # the ledger's settle before it was sent (None: not asked)
    match_mode: str = ""  # x-cortex-match-mode
    match_reason: str = ""  # x-cortex-match-reason (absent: "")
    request_id: str = ""  # x-request-id (the gateway's log lines name it)
    explained: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per worker ``(index_tokens, predicted_tokens)`` of ``/admin/explain`` just before the
    request was sent (with an admin token): whether an excess came from the ledger or from
    the gateway's predicted blocks."""

    @property
    def exact(self) -> bool:
        return self.predicted == self.cached

    @property
    def over(self) -> bool:
        return self.predicted > self.cached


@dataclass(frozen=True, slots=True)
class Removal:
    """A batch with ``BlockRemoved`` events, as the watch received it (wall clock, s)."""

    arrived: float  # when the watch's SUB got it
    stamped: float  # the engine's batch timestamp (taken from its scheduler, before publishing)
    blocks: int
    received: int = 0  # how many batches (of any worker) the watch had taken in before it


@dataclass(frozen=True, slots=True)
class Settled:
    """One settle (:class:`Settle`): the watch's batches it covered and how long it took."""

    received: int  # batches the watch had taken in when it began: all of them were applied
    waited_s: float  # until the gateway's replica held them (scrapes included)
    looks: int  # conditions checked (2: both stages held at the first look)
    timed_out: str = ""  # the stage that did not finish in time ("" when settled)


class EvictionWatch:
    """``BlockRemoved`` arrivals per worker, from a SUB on each engine's event endpoint (a
    thread; :meth:`close` ends it), and the blocks each engine said it holds since the
    watch subscribed (``held``: copies per hash, stored minus removed — vLLM reports each
    physical copy of a hash, as the ingest's ledger counts them — emptied by
    ``AllBlocksCleared``)."""

    def __init__(self, endpoints: dict[str, str]) -> None:
        self._ctx = zmq.Context()
        self._subs: dict[zmq.Socket[bytes], str] = {}
        for worker, endpoint in endpoints.items():
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(endpoint)
            self._subs[sub] = worker
        self.removed: dict[str, list[Removal]] = {w: [] for w in endpoints}
        self.held: dict[str, Counter[object]] = {w: Counter() for w in endpoints}
        self._stamps: dict[str, float] = {}  # each worker's last batch stamp (its publisher now)
        self._received = 0  # batches taken in (of every worker)
        self._held_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="eviction-watch")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                frames = sub.recv_multipart()
                arrived = time.time()
                try:
                    batch = decode_batch(parse_pub(frames).payload, Engine.VLLM)
                except CodecError:
                    continue
                worker = self._subs[sub]
                held = self.held[worker]
                blocks = 0
                with self._held_lock:
                    for event in batch.events:
                        if type(event) is BlockStored:
                            held.update(event.block_hashes)
                        elif type(event) is BlockRemoved:
                            blocks += len(event.block_hashes)
                            held.subtract(event.block_hashes)
                            for gone in [h for h in event.block_hashes if held[h] <= 0]:
                                del held[gone]
                        elif type(event) is AllBlocksCleared:
                            held.clear()
                    if blocks:
                        self.removed[worker].append(
                            Removal(arrived, batch.ts, blocks, self._received))
                    self._received += 1
                    self._stamps[worker] = batch.ts

    def restarted(self, worker: str) -> None:
        """``worker``'s engine was killed: what it held is gone (it publishes no
        ``AllBlocksCleared`` for that)."""
        with self._held_lock:
            self.held[worker].clear()
            self._stamps.pop(worker, None)

    def stamps(self) -> tuple[int, dict[str, float]]:
        """``(batches taken in, each worker's last batch stamp)``, read together: what a
        settle must see applied."""
        with self._held_lock:
            return self._received, dict(self._stamps)

    def held_blocks(self, worker: str) -> int:
        """How many distinct blocks ``worker``'s engine said it holds since the watch
        subscribed."""
        with self._held_lock:
            return len(self.held[worker])

    def in_flight(self, outcome: Outcome) -> bool:
        """Whether ``outcome``'s over-prediction is at most the blocks its worker evicted
        before the request was sent (the engine stamped the batch before) that the settle
        before it did not cover (they reached the watch after the settle began): published
        after the engine answered the previous request (its publisher thread sends a step's
        batch beside the step's outputs), or still on the wire; no router can know them.
        An outcome sent without a settle has no such allowance."""
        blocks = self.uncovered(outcome)
        return outcome.settled is not None and \
            math.ceil((outcome.predicted - outcome.cached) / BLOCK_TOKENS) <= blocks

    def uncovered(self, outcome: Outcome) -> int:
        """Blocks ``outcome``'s worker evicted in batches stamped before it was sent that its
        settle did not cover (0 without a settle)."""
        if outcome.settled is None:
            return 0
        covered = outcome.settled.received
        return sum(r.blocks for r in self.removed.get(outcome.worker, ())
                   if r.stamped <= outcome.sent_at and r.received >= covered)

    def recent(self, outcome: Outcome, span_s: float = 3.0) -> list[tuple[float, float, int]]:
        """``(s before the request was sent: the batch arrived, the engine stamped it;
        blocks)`` of its worker's removals in the ``span_s`` around it (what a failure report
        shows; negative: after)."""
        sent = outcome.sent_at
        return [(round(sent - r.arrived, 3), round(sent - r.stamped, 3), r.blocks)
                for r in self.removed.get(outcome.worker, ())
                if abs(sent - r.arrived) <= span_s or abs(sent - r.stamped) <= span_s]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sub in self._subs:
            sub.close(linger=0)
        self._ctx.term()


class Settle:
    """Waits (bounded) until the gateway's ledger replica holds every batch the watch has
    taken in from the engines: the ingest has applied each worker's last stamped batch
    (``cortex_ingest_last_batch_timestamp_seconds``) and handed all of it to the index
    (``cortex_ingest_index_idle``), then the replica's version (``/admin/explain``'s
    ``index_version``) reaches the index's (``cortex_index_version``). A request sent after
    it can be over-predicted only by what the engine published after the settle began
    (:meth:`EvictionWatch.in_flight`). It does not wait on a timer: each stage polls its
    condition every 10 ms for at most ``timeout_s``; one that does not finish is recorded
    (:attr:`Settled.timed_out`), not hidden."""

    def __init__(self, watch: EvictionWatch, ingest_metrics_url: str, index_metrics_url: str,
                 timeout_s: float = 10.0) -> None:
        self.watch = watch
        self.ingest_metrics_url = ingest_metrics_url
        self.index_metrics_url = index_metrics_url
        self.timeout_s = timeout_s

    def __call__(self, replica_version: Callable[[], int]) -> Settled:
        start = time.monotonic()
        received, stamps = self.watch.stamps()
        deadline = start + self.timeout_s
        done, looks = _poll(lambda: self._ingest_has(stamps), deadline)
        if not done:
            return Settled(received, time.monotonic() - start, looks, "ingest")
        version = int(_metric(_scrape(self.index_metrics_url), "cortex_index_version")[0][1])
        done, more = _poll(lambda: replica_version() >= version, deadline)
        return Settled(received, time.monotonic() - start, looks + more,
                       "" if done else "replica")

    def _ingest_has(self, stamps: dict[str, float]) -> bool:
        text = _scrape(self.ingest_metrics_url)
        applied = {_label(labels, "worker"): value for labels, value in
                   _metric(text, "cortex_ingest_last_batch_timestamp_seconds")}
        idle = [value for _, value in _metric(text, "cortex_ingest_index_idle")]
        return (all(applied.get(w, -1.0) >= ts for w, ts in stamps.items())
                and bool(idle) and all(v == 1.0 for v in idle))


def _poll(condition: Callable[[], bool], deadline: float) -> tuple[bool, int]:
    """``(whether condition held by deadline, times it was checked)``: :func:`wait_until`
    every 10 ms, counting its looks."""
    looks = 0

    def look() -> bool:
        nonlocal looks
        looks += 1
        return condition()

    try:
        wait_until(look, timeout=max(deadline - time.monotonic(), 0.0),
                   what="the ledger to settle")
    except TimeoutError:
        return False, looks
    return True, looks


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return str(response.read().decode())


def _metric(text: str, name: str) -> list[tuple[str, float]]:
    """``(labels, value)`` of every sample of ``name`` in a Prometheus text page."""
    return [(labels, float(value)) for labels, value in
            re.findall(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", text, re.MULTILINE)]


def _label(labels: str, name: str) -> str:
    found = re.search(rf'{name}="([^"]*)"', labels)
    return found.group(1) if found else ""


@dataclass
class Tally:
    """Every outcome of a run, and the requests that failed (``(turn, status, body)``)."""

    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def exact(self) -> int:
        return sum(o.exact for o in self.outcomes)

    @property
    def over(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.over]

    def summary(self) -> dict[str, Any]:
        done = self.outcomes
        return {"requests": len(done), "failed": len(self.failures), "exact": self.exact,
                "over_predictions": len(self.over),
                "under_predictions": sum(o.predicted < o.cached for o in done),
                "streamed": sum(o.stream for o in done),
                "cached_tokens": sum(o.cached for o in done),
                "predicted_tokens": sum(o.predicted for o in done),
                "prompt_tokens": sum(o.prompt_tokens for o in done),
                "by_worker": {w: sum(o.worker == w for o in done)
                              for w in sorted({o.worker for o in done})},
                "settle": _settle_summary([o.settled for o in done if o.settled is not None])}


def _settle_summary(settles: list[Settled]) -> dict[str, Any]:
    """How long the ledger took to hold what the engines had published before each request
    (ms), and how often it was behind (more than one look) or never got there."""
    if not settles:
        return {"settles": 0}
    waits = sorted(s.waited_s * 1e3 for s in settles)
    return {"settles": len(settles), "behind": sum(s.looks > 2 for s in settles),
            "timed_out": [s.timed_out for s in settles if s.timed_out],
            "wait_ms_p50": round(waits[len(waits) // 2], 1),
            "wait_ms_p90": round(waits[int(len(waits) * 0.9)], 1),
            "wait_ms_max": round(waits[-1], 1)}


class ChatWorkload:
    """Conversations that grow turn by turn (a user message, then the engine's answer),
    chosen at random; one restarts with a new system prompt once it nears ``max_tokens``
    (prompt tokens). Sequential: each prediction is checked against a settled cache."""

    def __init__(self, gateway_url: str, model: str, *, seed: int = 28, conversations: int = 24,
                 stream_share: float = 0.3, max_tokens: int = 3200,
                 admin_token: str | None = None) -> None:
        self.url = gateway_url.rstrip("/")
        self.admin_token = admin_token
        self.model = model
        self.rng = random.Random(seed)
        self.stream_share = stream_share
        self.max_tokens = max_tokens
        self.chats: list[list[dict[str, str]]] = [self._opening(i) for i in range(conversations)]
        self.prompt_tokens = [0] * conversations
        self.tally = Tally()
        self.turn = 0
        self.settle: Settle | None = None  # before each request, when set (needs admin_token)

    def _opening(self, number: int) -> list[dict[str, str]]:
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randrange(150, 700)))
        return [{"role": "system", "content": f"[chat {number}.{self.rng.randrange(10**6)}] "
                                              f"You answer briefly. {words}"}]

    def run(self, requests: int) -> None:
        for _ in range(requests):
            self.step()

    def step(self) -> None:
        """One turn of a random conversation."""
        self.turn += 1
        index = self.rng.randrange(len(self.chats))
        if self.prompt_tokens[index] > self.max_tokens:
            self.chats[index] = self._opening(index)
        words = " ".join(self.rng.choice(_WORDS) for _ in range(self.rng.randrange(10, 120)))
        messages = [*self.chats[index], {"role": "user", "content": words}]
        stream = self.rng.random() < self.stream_share
        body: dict[str, Any] = {"model": self.model, "messages": messages,
                                "max_tokens": self.rng.randrange(4, 24), "ignore_eos": True,
                                "temperature": 0}
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        settled = None
        if self.settle is not None:
            settled = self.settle(lambda: self._replica_version(body))
        explained = self._explain(body)
        sent_at = time.time()
        status, headers, raw = post(self.url + "/v1/chat/completions", body)
        if status != 200:
            self.tally.failures.append((self.turn, status, raw[:300].decode(errors="replace")))
            return
        answer, usage = _streamed(raw) if stream else _whole(raw)
        self.chats[index] = [*messages, {"role": "assistant", "content": answer}]
        self.prompt_tokens[index] = int(usage["prompt_tokens"])
        details = usage.get("prompt_tokens_details") or {}
        self.tally.outcomes.append(Outcome(
            turn=self.turn, worker=headers.get("x-cortex-assigned-worker", "?"), stream=stream,
            prompt_tokens=int(usage["prompt_tokens"]),
            predicted=int(headers.get("x-cortex-cache-hit-tokens", "0")),
            cached=int(details.get("cached_tokens") or 0),
            attempts=int(headers.get("x-cortex-attempts", "1")), sent_at=sent_at,
            settled=settled,
            match_mode=headers.get("x-cortex-match-mode", ""),
            match_reason=headers.get("x-cortex-match-reason", ""),
            request_id=headers.get("x-request-id", ""), explained=explained))

    def _explain(self, body: dict[str, Any]) -> dict[str, tuple[int, int]]:
        """The gateway's view of ``body`` per worker (empty without an admin token)."""
        if self.admin_token is None:
            return {}
        return {c["worker"]: (int(c["index_tokens"]), int(c["predicted_tokens"]))
                for c in self._explained(body)["candidates"]}

    def _replica_version(self, body: dict[str, Any]) -> int:
        """The index version of the ledger the gateway would route ``body`` on now."""
        return int(self._explained(body)["index_version"])

    def _explained(self, body: dict[str, Any]) -> dict[str, Any]:
        assert self.admin_token is not None
        status, _, raw = post(self.url + "/admin/explain", body,
                              {"Authorization": f"Bearer {self.admin_token}"})
        assert status == 200, raw[:300]
        return dict(json.loads(raw))


def post(url: str, body: Any, headers: dict[str, str] | None = None
         ) -> tuple[int, dict[str, str], bytes]:
    """A JSON POST: ``(status, lower-cased headers, body)``; HTTP errors are answers too."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return (int(response.status), {k.lower(): v for k, v in response.headers.items()},
                    response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _whole(raw: bytes) -> tuple[str, dict[str, Any]]:
    body = json.loads(raw)
    return str(body["choices"][0]["message"]["content"] or ""), dict(body["usage"])


def _streamed(raw: bytes) -> tuple[str, dict[str, Any]]:
    """The answer text and the usage chunk of an SSE chat stream (``data: [DONE]`` last)."""
    text, usage = [], None
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-1:]
    for event in events[:-1]:
        assert event.startswith("data: "), event[:80]
        chunk = json.loads(event[len("data: "):])
        for choice in chunk.get("choices") or ():
            text.append((choice.get("delta") or {}).get("content") or "")
        if chunk.get("usage"):
            usage = chunk["usage"]
    assert usage is not None, "no usage chunk in the stream"
    return "".join(text), dict(usage)
