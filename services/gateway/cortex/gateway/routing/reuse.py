"""Reuse accounting: what prefix cache a routed request could have used, what the routing
captured, what the engine delivered (pure).

* ``available`` — the longest prompt prefix (tokens) any eligible worker held when the
  request was routed: its READY ledger (device, then host / disk tiers), its predicted
  blocks or its session's previous turn, whether or not the decision credited it;
* ``captured`` — what the worker that served it held (``available - captured`` is what
  the decision gave up, and ``given_up`` says why: the better holder was over its high
  watermark, its load outweighed the hit, the first choice failed and a retry went
  elsewhere, ...);
* ``delivered`` — the cached prompt tokens the engine reported in its usage (``None``
  until the answer's usage is read, or when the engine did not say).

On a truthful ledger ``delivered <= captured <= available``: an engine can only reuse what
it holds (``captured`` counts every block the engine can hit: the query stops one token
short of the prompt's end, like the engines). ``delivered > captured`` means the ledger
lagged behind the engine; ``delivered`` well below ``captured`` means the ledger holds
blocks the engine no longer has (docs/operations.md "Why is my hit rate low").
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.routing.scoring import Decision, PairDecision

__all__ = ["GivenUp", "Reuse", "count_reuse", "reuse_of"]


class GivenUp:
    """The ``given_up`` reasons that are not a candidate's credit note (``over_watermark``,
    ``ledger_stale``, ``block_size_mismatch``, ... name themselves)."""

    NONE = "none"  # nothing given up
    LOAD = "load"  # the holder's load outweighed its hit
    KV_PRESSURE = "kv_pressure"  # the holder's KV pool was full: storing there evicts
    RETRY = "retry"  # the chosen worker failed before answering; another served it


@dataclass(frozen=True, slots=True)
class Reuse:
    """A request's reuse (tokens), see the module docstring."""

    available: int
    captured: int
    given_up: str = GivenUp.NONE
    delivered: int | None = None

    @property
    def lost(self) -> int:
        """Tokens the decision gave up (``available - captured``)."""
        return self.available - self.captured

    def with_delivered(self, delivered: int | None) -> Reuse:
        return replace(self, delivered=delivered)

    def header(self) -> bytes:
        """The ``x-cortex-reuse`` header value: ``available=A; captured=C; given_up=R``,
        then ``; delivered=D`` once known."""
        text = f"available={self.available}; captured={self.captured}; given_up={self.given_up}"
        if self.delivered is not None:
            text += f"; delivered={self.delivered}"
        return text.encode()

    def log_fields(self) -> dict[str, int | str | None]:
        """The access log's fields."""
        return {"reuse_available": self.available, "reuse_captured": self.captured,
                "reuse_given_up": self.given_up, "reuse_delivered": self.delivered}


def reuse_of(decision: Decision, worker_id: str, unranked: int | None = None) -> Reuse:
    """``available`` and ``captured`` of ``decision`` when ``worker_id`` serves the request
    (the decision's choice, or a fallback after it failed). ``unranked``: what
    ``worker_id`` holds when the decision did not rank it (a PD decode worker prefilling
    itself: its credited hit)."""
    ranked = any(s.worker_id == worker_id for s in decision.ranked)
    captured = unranked if unranked is not None and not ranked else 0
    available, best = captured, None
    for scored in decision.ranked:
        held = PairDecision.held_tokens(scored)
        if held > available:
            available, best = held, scored
        if scored.worker_id == worker_id:
            captured = held
    if captured >= available or best is None:
        return Reuse(available, captured)
    if best.note:
        why = best.note
    elif worker_id != decision.chosen.worker_id:
        why = GivenUp.RETRY
    elif best.candidate.kv_pressure > 0:
        why = GivenUp.KV_PRESSURE
    else:
        why = GivenUp.LOAD
    return Reuse(available, captured, why)


def count_reuse(metrics: GatewayMetrics, model: str, worker_id: str, reuse: Reuse,
                prompt_tokens: int) -> None:
    """Count an answered request's reuse: the three totals only when the engine said what
    it delivered (so that they compare), else it is counted as unreported."""
    if reuse.delivered is None:
        metrics.child(metrics.reuse_unreported, model).inc()
        return
    tokens = metrics.reuse_tokens
    metrics.worker(tokens, worker_id, model, "available").inc(reuse.available)
    metrics.worker(tokens, worker_id, model, "captured").inc(reuse.captured)
    metrics.worker(tokens, worker_id, model, "delivered").inc(reuse.delivered)
    metrics.worker(metrics.reuse_prompt_tokens, worker_id, model).inc(prompt_tokens)
    if reuse.lost:
        metrics.child(metrics.reuse_given_up, model, reuse.given_up).inc(reuse.lost)
