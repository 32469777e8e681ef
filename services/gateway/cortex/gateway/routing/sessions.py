"""Session hints: which worker served an agent session's last turn, and how many live
sessions each worker is home to (pure, bounded).

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
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cortex.gateway.config.gateway import SessionConfig

__all__ = ["MAX_SESSION_CHARS", "SessionHint", "SessionTable", "Turn", "session_of"]

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
