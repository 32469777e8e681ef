"""Where a routed request's prompt is being computed, and the load counted for it.

A recorded decision takes effect at once, before the request is dispatched: the worker
that will compute the prompt is credited with its blocks (predicted blocks) and counted as
one more active request (``WorkerState.pending``), so requests routed a moment later —
a simultaneous burst of one new prefix — follow it. Dispatch moves that credit when a
failure before the first byte sends the request elsewhere.

Predicted blocks: a short-lived side index so a burst of one new prefix co-locates.
At the routing decision the chosen worker is credited with the request's full blocks for
``ttl_s`` seconds, before its ``BlockStored`` events can reach the index — so requests
routed a moment later already see the credit. Predictions never enter the event-driven
ledger; they are dropped when they expire, when the worker's ledger is cleared, when the
worker leaves, or when the request is withdrawn from the worker (it failed before
computing the prompt there).

Each credit covers a whole chain from the first block, so a worker's predicted keys are
prefix-closed (if block *i* is predicted, so is every block before it, by a credit at least
as late). A lookup therefore walks the query's keys from the start and stops at the first
key nobody holds.

Memory tiers: a prediction stands for device blocks. When the worker's device ledger drops
a predicted key (evicted, maybe to its host tier), the prediction goes with it; a host copy
is then credited through the ledger's host tier, at its weight (the engine reports blocks
loaded back as cached, so the hit stays predicted, and never above what some tier holds).

**Sessions** (the section after placement): session hints, which worker served an agent
session's last turn, and how many live sessions each worker is home to (pure, bounded).

A client names its session with a header (``x-claude-code-session-id``, ``session-id``,
``thread-id``, ``x-session-id``: ``routing.sessions.headers``) or OpenAI's
``prompt_cache_key`` body field; :func:`session_of` reads it. The :class:`SessionTable`
remembers per ``(model, session)`` the worker its last turn was routed to and that turn's
prompt blocks (the last block's key and how many), for ``ttl_s`` after the turn and for
the ``max_sessions`` most recently seen sessions.

What routing takes from it (the rule, :mod:`.scoring`): the session's worker breaks ties;
when this turn's prompt continues the last one (its block at the same position has the same
key: block keys chain, so the whole prefix is equal), the worker is credited with the last
turn's blocks — the ledger may not have seen them yet (the events are in flight, or the
index lags) — unless the engine has since evicted that last block
(:meth:`SessionTable.forget_keys`); the ledger's own hit, when longer, wins. A worker's
*live* sessions (last turn routed within ``live_s``) count as load there between turns.

**Agent terms** (the last section): the agent terms of one routing decision, the session hint,
each worker's other live sessions and its KV pressure — what
:class:`~cortex.gateway.routing.scoring.Candidate` takes beside the ledger match
(docs/gateway.md "Session hints", "Routing" step 7).

The router asks :meth:`AgentTerms.request` once per request and
:meth:`RequestTerms.candidate` once per candidate; a recorded decision tells the session
table where the turn went (:meth:`RequestTerms.routed`).
"""

from __future__ import annotations

import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypedDict

from cortex.gateway.config.gateway import RoutingConfig, SessionConfig
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.ledger.replica_client import LeadingRuns
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import kv_pressure

__all__ = [
    "MAX_SESSION_CHARS",
    "AgentFields",
    "AgentTerms",
    "BlocksOf",
    "Credit",
    "KeysFor",
    "Placement",
    "PredictedBlocks",
    "RequestTerms",
    "SessionHint",
    "SessionTable",
    "Turn",
    "WalkedPredictions",
    "session_of",
]


# ---- predicted ----


class Credit:
    """One decision's prediction: ``keys`` credited to ``worker_id`` until ``expires``
    (monotonic seconds), while ``live``. The handle :meth:`PredictedBlocks.withdraw` takes."""

    __slots__ = ("evictions", "expires", "keys", "live", "worker_id")

    def __init__(self, worker_id: str, keys: list[int], expires: float, evictions: int) -> None:
        self.worker_id = worker_id
        self.keys = keys
        self.expires = expires
        self.evictions = evictions  # the worker's eviction count when credited
        self.live = True

    def __repr__(self) -> str:
        return (f"Credit({self.worker_id}, blocks={len(self.keys)}, expires={self.expires:.3f},"
                f" live={self.live})")


class PredictedBlocks:
    """``key → {worker_id: latest live Credit}`` with expiry in insertion order (constant
    TTL).

    Bounded by ``max_keys`` (key, worker) credits: the oldest credits go first. Pure and
    synchronous; the clock (seconds) is injectable. ``version`` grows with every change
    (a credit, a withdrawal, a forgotten key or worker, an expiry), so an answer computed
    earlier is still the answer while it is unchanged.
    """

    def __init__(
        self,
        ttl_s: float,
        max_keys: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        self._holders: dict[int, dict[str, Credit]] = {}
        self._log: deque[Credit] = deque()
        self._credits = 0
        self._evictions: defaultdict[str, int] = defaultdict(int)
        self.version = 0

    def credit(self, worker_id: str, keys: list[int]) -> Credit | None:
        """Credit ``worker_id`` with the chain ``keys`` (a prompt's blocks) for ``ttl_s``;
        ``None`` when predictions are off or there is no block."""
        if self.ttl_s <= 0 or not keys:
            return None
        now = self._clock()
        self._expire(now)
        self.version += 1
        credit = Credit(worker_id, keys, now + self.ttl_s, self._evictions[worker_id])
        holders = self._holders
        for key in keys:
            entry = holders.get(key)
            if entry is None:
                holders[key] = {worker_id: credit}
            else:
                entry[worker_id] = credit
        self._log.append(credit)
        self._credits += len(keys)
        while self._credits > self.max_keys and self._log:
            self._pop_oldest()
        return credit

    def withdraw(self, credit: Credit) -> None:
        """Take ``credit`` back (its request will not compute the prompt on that worker).

        Keys it was the latest credit for fall back to the worker's newest older live
        credit covering them (another request with the same prefix still running there),
        unless the engine evicted blocks of that worker since: then they are dropped, which
        can only under-predict."""
        if not credit.live:
            return
        self.version += 1
        orphaned = self._retire(credit)
        worker_id = credit.worker_id
        holders = self._holders
        evictions = self._evictions[worker_id]
        for older in reversed(self._log):
            if not orphaned:
                break
            if older.worker_id != worker_id or not older.live or older.evictions != evictions:
                continue
            for key in older.keys:
                if key in orphaned:
                    orphaned.discard(key)
                    holders.setdefault(key, {})[worker_id] = older

    def match(self, keys: list[int], start: int = 0) -> dict[str, int]:
        """Per worker, how many leading blocks of ``keys[start:]`` are predicted (absent =
        0); ``keys`` is a chain from its root block."""
        if not self._holders or start >= len(keys):
            return {}
        self._expire(self._clock())
        holders = self._holders
        entry = holders.get(keys[start])
        if entry is None:
            return {}
        evictions, count = self._evictions, len(keys)
        out: dict[str, int] = {}
        for worker_id, credit in entry.items():
            # the worker holds keys[at] by ``credit``; a credit made since its worker's
            # last eviction still holds every one of its keys, so the run goes on at least
            # as far as that credit's chain agrees with the query's (found by bisection:
            # keys chain, so two chains that agree at a position agree before it)
            at = start
            while True:
                if credit.evictions == evictions[worker_id]:
                    at = _agreed(credit.keys, keys, at)
                else:
                    at += 1
                if at == count:
                    break
                entry = holders.get(keys[at])
                later = entry.get(worker_id) if entry is not None else None
                if later is None:
                    break
                credit = later
            out[worker_id] = at - start
        return out

    def forget_worker(self, worker_id: str) -> None:
        """Drop every prediction for ``worker_id`` (its cache was cleared or it left)."""
        self._evictions[worker_id] += 1
        self.version += 1
        holders = self._holders
        for credit in self._log:
            if credit.worker_id != worker_id or not credit.live:
                continue
            credit.live = False
            self._credits -= len(credit.keys)
            for key in credit.keys:
                entry = holders.get(key)
                if entry is not None and entry.pop(worker_id, None) is not None and not entry:
                    del holders[key]

    def forget_keys(self, worker_id: str, keys: Iterable[int]) -> None:
        """Drop predictions of these blocks for ``worker_id`` (the engine evicted them)."""
        holders = self._holders
        dropped = False
        for key in keys:
            entry = holders.get(key)
            if entry is not None and entry.pop(worker_id, None) is not None:
                dropped = True
                if not entry:
                    del holders[key]
        if dropped:  # older credits of these keys must not come back on a withdrawal
            self._evictions[worker_id] += 1
            self.version += 1

    def expire(self) -> int:
        """Drop the credits expired by now; the :attr:`version` after it."""
        self._expire(self._clock())
        return self.version

    def _expire(self, now: float) -> None:
        log = self._log
        while log and log[0].expires <= now:
            self._pop_oldest()

    def _pop_oldest(self) -> None:
        self.version += 1
        credit = self._log.popleft()
        if credit.live:  # else withdrawn or forgotten: already accounted for
            self._retire(credit)

    def _retire(self, credit: Credit) -> set[int]:
        """End a live ``credit``: the keys it is still the latest credit for (no later credit
        refreshed them) lose it; returns those keys."""
        credit.live = False
        self._credits -= len(credit.keys)
        worker_id = credit.worker_id
        holders = self._holders
        dropped: set[int] = set()
        for key in credit.keys:
            entry = holders.get(key)
            if entry is not None and entry.get(worker_id) is credit:
                del entry[worker_id]
                if not entry:
                    del holders[key]
                dropped.add(key)
        return dropped

    def __len__(self) -> int:
        return len(self._holders)

    def __repr__(self) -> str:
        return (
            f"PredictedBlocks(keys={len(self._holders)}, credits={self._credits},"
            f" ttl_s={self.ttl_s})"
        )


def _agreed(chain: list[int], keys: list[int], at: int) -> int:
    """How many leading keys ``chain`` and ``keys`` share, knowing they share ``keys[at]``
    at position ``at`` when ``chain`` has it there (else ``at + 1``: a key the worker holds
    by another position of ``chain``, a run found one key at a time)."""
    high = min(len(chain), len(keys))
    if at >= high or chain[at] != keys[at]:
        return at + 1
    if chain[high - 1] == keys[high - 1]:
        return high
    low = at + 1  # chain[low - 1] agrees, chain[high - 1] does not
    high -= 1
    while low < high:
        mid = (low + high + 1) // 2
        if chain[mid - 1] == keys[mid - 1]:
            low = mid
        else:
            high = mid - 1
    return low


class WalkedPredictions:
    """The predicted blocks a lazy walk asked about (``runs``: per worker, its leading run
    of the walk's keys), so that the decision's own question about the same keys matches
    only the keys past them: the walk's runs are the answer while the predictions are
    unchanged since before the walk (:attr:`PredictedBlocks.version`), else the question is
    asked anew."""

    __slots__ = ("_predicted", "_version", "runs")

    def __init__(self, predicted: PredictedBlocks) -> None:
        self._predicted = predicted
        self._version = predicted.expire()
        self.runs: LeadingRuns[str] = LeadingRuns()

    def match(self, keys: list[int]) -> dict[str, int]:
        """``PredictedBlocks.match(keys)``, for ``keys`` of the walk's chain (the walked
        keys, or more or fewer of them)."""
        predicted, runs = self._predicted, self.runs
        if predicted.expire() == self._version:
            runs.ask(keys, predicted.match)
        if predicted.version != self._version:
            return predicted.match(keys)
        count = len(keys)
        return {worker_id: min(run, count) for worker_id, run in runs.runs.items()} if count else {}


# ---- placement ----


KeysFor = Callable[[str, list[int], Mapping[int, list[int]] | None], list[int]]
"""``(worker_id, keys, keysets)`` → the prompt's keys in that worker's key set."""


class Placement:
    """The worker credited with a routed request's blocks (predicted blocks), and the load
    the decision counted before dispatch.

    :meth:`move` re-credits another worker (a retry), :meth:`withdraw` takes the credit
    back (the worker failed or refused before computing the prompt), :meth:`dispatched`
    hands the counted load over to the in-flight slots of the attempts (idempotent; also
    called when the request ends without a dispatch). A placement of an unrecorded decision
    (explain) starts empty.
    """

    __slots__ = ("_credit", "_keys_for", "_metrics", "_pending", "_predicted", "keys",
                 "keysets")

    def __init__(self, predicted: PredictedBlocks, keys_for: KeysFor, metrics: GatewayMetrics,
                 keys: list[int], keysets: Mapping[int, list[int]] | None = None) -> None:
        self._predicted = predicted
        self._keys_for = keys_for
        self._metrics = metrics
        self.keys = keys
        self.keysets = keysets
        self._credit: Credit | None = None
        self._pending: list[tuple[WorkerState, int]] = []

    @property
    def worker_id(self) -> str | None:
        """The worker credited now, if any."""
        credit = self._credit
        return credit.worker_id if credit is not None and credit.live else None

    def move(self, worker_id: str) -> None:
        """The prompt will be computed on ``worker_id`` (a no-op if it is credited)."""
        if self.worker_id == worker_id:
            return
        self.withdraw()
        keys = self._keys_for(worker_id, self.keys, self.keysets)
        self._credit = self._predicted.credit(worker_id, keys)
        self._metrics.predicted_keys.set(len(self._predicted))

    def complete(self, keys: list[int]) -> None:
        """The prompt's whole ``keys`` are known now (a lazy walk was finished): the worker
        credited now, if any, is credited with all of them."""
        self.keys = keys
        worker_id = self.worker_id
        if worker_id is not None:
            self.withdraw()
            self.move(worker_id)

    def withdraw(self) -> None:
        credit, self._credit = self._credit, None
        if credit is not None:
            self._predicted.withdraw(credit)
            self._metrics.predicted_keys.set(len(self._predicted))

    def hold(self, worker: WorkerState, prefill_tokens: int = 0) -> None:
        """Count the request, and the ``prefill_tokens`` it will compute, on ``worker``
        until :meth:`dispatched` (from there dispatch counts them per attempt)."""
        worker.hold(prefill_tokens)
        self._pending.append((worker, prefill_tokens))

    def dispatched(self) -> None:
        pending, self._pending = self._pending, []
        for worker, prefill_tokens in pending:
            worker.unhold(prefill_tokens)

    def __repr__(self) -> str:
        return f"Placement(worker={self.worker_id}, pending={len(self._pending)})"


# ---- sessions ----

MAX_SESSION_CHARS = 256
"""Longer session ids are ignored (a header is not a place for a payload)."""


def session_of(headers: Mapping[str, str], body: Mapping[str, Any],
               config: SessionConfig) -> str | None:
    """The session a request names: the first configured header present (lower-case
    names), else its ``prompt_cache_key``; ``None`` when none, when hints are off, or when
    the value is empty, too long or not printable."""
    if not config.enabled:
        return None
    for name in config.headers:
        value = headers.get(name)
        if value:
            return _sane(value)
    if config.prompt_cache_key:
        key = body.get("prompt_cache_key")
        if isinstance(key, str) and key:
            return _sane(key)
    return None


def _sane(value: str) -> str | None:
    value = value.strip()
    if not 0 < len(value) <= MAX_SESSION_CHARS or not value.isprintable():
        return None
    return value


@dataclass(frozen=True, slots=True)
class SessionHint:
    """What the table says of a request's session: its ``worker``, and ``blocks``: how many
    leading blocks of this prompt the last turn sent there (0 when the prompt does not
    continue it, or the engine evicted its end)."""

    worker_id: str
    blocks: int


class Turn:
    """A session's last turn: the worker, its prompt's block count and last key, when."""

    __slots__ = ("blocks", "last_key", "seen", "worker_id")

    def __init__(self, worker_id: str, blocks: int, last_key: int | None, seen: float) -> None:
        self.worker_id = worker_id
        self.blocks = blocks
        self.last_key = last_key
        self.seen = seen

    def __repr__(self) -> str:
        return f"Turn({self.worker_id}, blocks={self.blocks}, seen={self.seen:.3f})"


_Key = tuple[str, str]  # (model, session)


class SessionTable:
    """``(model, session) → Turn``, least recently seen first; live counts per worker.

    Bounded by ``max_sessions`` and ``ttl_s`` (seconds since the last turn); sessions seen
    within ``live_s`` are live. Not thread-safe (the event loop); the clock is injectable
    (monotonic seconds)."""

    def __init__(self, ttl_s: float, live_s: float, max_sessions: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.live_s = min(live_s, ttl_s)
        self.max_sessions = max_sessions
        self._clock = clock
        self._turns: OrderedDict[_Key, Turn] = OrderedDict()
        self._live: OrderedDict[_Key, str] = OrderedDict()  # key → worker, seen order
        self._live_counts: dict[str, int] = {}
        self._by_last: dict[tuple[str, int], set[_Key]] = {}  # (worker, last key) → sessions
        self.evicted = 0  # sessions dropped by the bound (not by age)

    @classmethod
    def from_config(cls, config: SessionConfig) -> SessionTable:
        return cls(config.ttl_s, config.live_s, config.max_sessions)

    # ---- routing's questions ----

    def hint(self, model: str, session: str, keys: list[int]) -> SessionHint | None:
        """The session's worker and how many leading blocks of ``keys`` (this prompt's
        block keys) its last turn sent there; ``None`` for an unknown session."""
        self._expire(self._clock())
        turn = self._turns.get((model, session))
        if turn is None:
            return None
        n = turn.blocks
        continues = (turn.last_key is not None and 0 < n <= len(keys)
                     and keys[n - 1] == turn.last_key)
        return SessionHint(turn.worker_id, n if continues else 0)

    def blocks(self, model: str, session: str) -> int:
        """How many prompt blocks the session's last turn sent (0: unknown, or evicted)."""
        turn = self._turns.get((model, session))
        return turn.blocks if turn is not None and turn.last_key is not None else 0

    def live(self, worker_id: str, besides: tuple[str, str] | None = None) -> int:
        """Sessions whose last turn was routed to ``worker_id`` within ``live_s``, not
        counting ``besides`` (``(model, session)``: the request's own)."""
        self._expire(self._clock())
        n = self._live_counts.get(worker_id, 0)
        if besides is not None and self._live.get(besides) == worker_id:
            n -= 1
        return n

    # ---- what routing tells it ----

    def record(self, model: str, session: str, worker_id: str, keys: list[int]) -> None:
        """The session's turn was routed to ``worker_id`` with the prompt blocks ``keys``."""
        self._put((model, session), worker_id, len(keys), keys[-1] if keys else None)

    def moved(self, model: str, session: str, worker_id: str) -> None:
        """The turn was served by ``worker_id`` after all (a retry elsewhere)."""
        turn = self._turns.get((model, session))
        if turn is not None and turn.worker_id != worker_id:
            self._put((model, session), worker_id, turn.blocks, turn.last_key)

    def _put(self, key: _Key, worker_id: str, blocks: int, last_key: int | None) -> None:
        now = self._clock()
        self._expire(now)
        old = self._turns.pop(key, None)
        if old is not None:
            self._unlink(key, old)
        turn = Turn(worker_id, blocks, last_key, now)
        self._turns[key] = turn
        if turn.last_key is not None:
            self._by_last.setdefault((worker_id, turn.last_key), set()).add(key)
        self._live[key] = worker_id
        self._live_counts[worker_id] = self._live_counts.get(worker_id, 0) + 1
        while len(self._turns) > self.max_sessions:
            oldest, dropped = self._turns.popitem(last=False)
            self._unlink(oldest, dropped)
            self.evicted += 1

    def forget_keys(self, worker_id: str, keys: Iterable[int]) -> None:
        """The engine evicted these blocks of ``worker_id``: turns ending in one of them are
        no longer credited (the worker stays the session's tie-breaker)."""
        if not self._by_last:
            return
        for k in keys:
            sessions = self._by_last.pop((worker_id, k), None)
            for key in sessions or ():
                turn = self._turns.get(key)
                if turn is not None:
                    turn.blocks, turn.last_key = 0, None

    def forget_worker(self, worker_id: str) -> None:
        """``worker_id`` left or its cache was cleared: its sessions start over."""
        for key in [k for k, t in self._turns.items() if t.worker_id == worker_id]:
            self._unlink(key, self._turns.pop(key))

    # ---- bookkeeping ----

    def _expire(self, now: float) -> None:
        live, turns = self._live, self._turns
        while live:
            key, worker_id = next(iter(live.items()))
            turn = turns.get(key)
            if turn is not None and turn.worker_id == worker_id and turn.seen + self.live_s > now:
                break
            live.popitem(last=False)
            self._count_down(worker_id)
        while turns:
            key, turn = next(iter(turns.items()))
            if turn.seen + self.ttl_s > now:
                break
            turns.popitem(last=False)
            self._unlink(key, turn)

    def _unlink(self, key: _Key, turn: Turn) -> None:
        """``turn`` (no longer in the table) leaves the live counts and the last-key map."""
        if self._live.get(key) == turn.worker_id:
            del self._live[key]
            self._count_down(turn.worker_id)
        if turn.last_key is not None:
            sessions = self._by_last.get((turn.worker_id, turn.last_key))
            if sessions is not None:
                sessions.discard(key)
                if not sessions:
                    del self._by_last[(turn.worker_id, turn.last_key)]

    def _count_down(self, worker_id: str) -> None:
        n = self._live_counts.get(worker_id, 0) - 1
        if n > 0:
            self._live_counts[worker_id] = n
        else:
            self._live_counts.pop(worker_id, None)

    def __len__(self) -> int:
        return len(self._turns)

    def __repr__(self) -> str:
        return (f"SessionTable(sessions={len(self._turns)}, live={len(self._live)},"
                f" ttl_s={self.ttl_s}, live_s={self.live_s})")


# ---- agent terms ----

BlocksOf = Callable[[WorkerState], int | None]
"""A worker's device blocks per the ledger (over its DP ranks); ``None``: not known."""


class AgentFields(TypedDict):
    """The :class:`Candidate` fields this module fills."""

    session: bool
    session_tokens: int
    sessions: int
    kv_pressure: float


class RequestTerms:
    """One request's agent terms: its session (if named), its hint, the prompt's keys."""

    __slots__ = ("_blocks_of", "_query_blocks", "_terms", "block_size", "hint", "keys",
                 "model", "session")

    def __init__(self, terms: AgentTerms, model: str, block_size: int, session: str | None,
                 keys: list[int], query_blocks: int, blocks_of: BlocksOf | None) -> None:
        self._terms = terms
        self.model = model
        self.block_size = block_size
        self.session = session
        self.keys = keys
        self._query_blocks = query_blocks
        self._blocks_of = blocks_of
        self.hint: SessionHint | None = None
        if session is not None:
            self.hint = terms.table.hint(model, session, keys)

    @property
    def new_session(self) -> bool:
        """The request names a session the table does not know (its first turn)."""
        return self.session is not None and self.hint is None

    def candidate(self, worker: WorkerState) -> AgentFields:
        """The agent fields of ``worker``'s candidate for this request."""
        terms = self._terms
        hint = self.hint
        home = hint is not None and hint.worker_id == worker.id
        session_tokens = 0
        # lookahead workers hit fewer blocks than the plain keys say: no session credit
        if home and hint is not None and not worker.kv_lookahead and not worker.spec.kv_eagle_drop:
            session_tokens = min(hint.blocks, self._query_blocks) * self.block_size
        besides = (self.model, self.session) if self.session is not None else None
        return AgentFields(session=home, session_tokens=session_tokens,
                           sessions=terms.table.live(worker.id, besides),
                           kv_pressure=terms.pressure(worker, self._blocks_of))

    def routed(self, worker_id: str) -> None:
        """The decision (recorded) sends this turn to ``worker_id``."""
        session = self.session
        if session is None:
            return
        terms = self._terms
        m = terms.metrics
        hint = self.hint
        outcome = "new" if hint is None else "kept" if hint.worker_id == worker_id else "moved"
        m.child(m.session_hints, outcome).inc()
        terms.table.record(self.model, session, worker_id, self.keys)
        m.sessions.set(len(terms.table))
        m.sessions_evicted.inc(terms.table.evicted - terms.evicted_seen)
        terms.evicted_seen = terms.table.evicted

    def served_by(self, worker_id: str) -> None:
        """A fallback served the turn after all (a failure before the first byte)."""
        if self.session is not None:
            self._terms.table.moved(self.model, self.session, worker_id)

    def __repr__(self) -> str:
        return f"RequestTerms(session={self.session!r}, hint={self.hint!r})"


OCCUPANCY_EVERY_S = 1.0
"""A worker's ``worker_kv_occupancy_ratio`` is set at most this often (seconds), not at every
decision that reads it: a gauge is scraped every few seconds, and setting it costs each
candidate of each request a lock."""


class AgentTerms:
    """The session table and the KV-pressure rule of one router."""

    def __init__(self, config: RoutingConfig, metrics: GatewayMetrics,
                 table: SessionTable | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.metrics = metrics
        self.table = table or SessionTable.from_config(config.sessions)
        self.evicted_seen = 0
        self._clock = clock
        self._occupancy_set: dict[str, float] = {}  # worker → when its gauge was last set

    def request(self, model: str, block_size: int, session: str | None, keys: list[int],
                query_blocks: int, blocks_of: BlocksOf | None) -> RequestTerms:
        return RequestTerms(self, model, block_size, session, keys, query_blocks, blocks_of)

    def pressure(self, worker: WorkerState, blocks_of: BlocksOf | None) -> float:
        """``worker``'s KV pressure (0..1): 0 without its capacity or its block count."""
        capacity = worker.kv_capacity
        if not capacity or blocks_of is None or not self.config.weights.kv_pressure:
            return 0.0
        blocks = blocks_of(worker)
        if blocks is None:
            return 0.0
        now = self._clock()
        if now - self._occupancy_set.get(worker.id, -OCCUPANCY_EVERY_S) >= OCCUPANCY_EVERY_S:
            self._occupancy_set[worker.id] = now
            self.metrics.worker(self.metrics.worker_kv_occupancy, worker.id).set(
                blocks / capacity)
        return kv_pressure(blocks, capacity, self.config.kv_full_fraction)

    def forget_keys(self, worker_id: str, keys: list[int]) -> None:
        self.table.forget_keys(worker_id, keys)

    def forget_worker(self, worker_id: str) -> None:
        self.table.forget_worker(worker_id)
        self._occupancy_set.pop(worker_id, None)
        self.metrics.sessions.set(len(self.table))

    def __repr__(self) -> str:
        return f"AgentTerms({self.table!r})"
