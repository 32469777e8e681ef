"""The agent terms of one routing decision: the session hint, each worker's other live
sessions and its KV pressure — what :class:`~cortex.gateway.routing.scoring.Candidate`
takes beside the ledger match (docs/gateway.md "Session hints", "Routing" step 7).

The router asks :meth:`AgentTerms.request` once per request and
:meth:`RequestTerms.candidate` once per candidate; a recorded decision tells the session
table where the turn went (:meth:`RequestTerms.routed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypedDict

from cortex.gateway.config.gateway import RoutingConfig
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import kv_pressure
from cortex.gateway.routing.sessions import SessionHint, SessionTable

__all__ = ["AgentFields", "AgentTerms", "BlocksOf", "RequestTerms"]

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


class AgentTerms:
    """The session table and the KV-pressure rule of one router."""

    def __init__(self, config: RoutingConfig, metrics: GatewayMetrics,
                 table: SessionTable | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.table = table or SessionTable.from_config(config.sessions)
        self.evicted_seen = 0

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
        self.metrics.worker(self.metrics.worker_kv_occupancy, worker.id).set(blocks / capacity)
        return kv_pressure(blocks, capacity, self.config.kv_full_fraction)

    def forget_keys(self, worker_id: str, keys: list[int]) -> None:
        self.table.forget_keys(worker_id, keys)

    def forget_worker(self, worker_id: str) -> None:
        self.table.forget_worker(worker_id)
        self.metrics.sessions.set(len(self.table))

    def __repr__(self) -> str:
        return f"AgentTerms({self.table!r})"
