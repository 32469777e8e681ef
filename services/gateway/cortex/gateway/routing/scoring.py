"""Scoring and the degrade chain: candidates with their matches and loads → one decision.

``score(w) = alpha*credit(w) - beta*busy(w) - gamma*queued(w) - delta*prefilling(w)
- kv_pressure*pressure(w)*uncached(w)`` where a worker's cache credit is its longest READY
prefix (index ledger, predicted blocks or its session's previous turn; a prefix continued
in the worker's host / disk tier counts those tokens times ``host_hit`` / ``disk_hit``, the
shared tier not at all), withheld when the
worker is at or over its high-watermark — affinity yields to load for that worker only —
and ``prefilling`` the uncached prompt tokens this gateway sent it that have not started
answering (the prefill queue ahead), less the blocks the request is credited with there
by prediction only (:func:`queue_ahead`: a queued request is computing them); the term is
left out for a worker holding at least ``delta_hit_share`` of the prompt
(:func:`holds_most`).

Paced agents: ``busy(w) = max(active(w), session*sessions(w))`` where ``sessions`` counts the
other live agent sessions whose last turn went to ``w`` (:mod:`.sessions`): between turns
an agent runs nothing, yet its next turn comes back to the prefix ``w`` holds, so its worker
must not read as idle to the next new session. The first turn of a session (``new_session``)
weighs them ``session_home`` each instead: it chooses the worker every later turn follows,
so the sessions living there share it with this one for as long as it runs, not just now
(a shared system prompt is worth replicating once rather than piling every session onto
its first holder).

KV occupancy: ``pressure(w)`` rises from 0 to 1 as the ledger's device blocks of ``w`` go
from ``kv_full_fraction`` of its capacity to all of it (:func:`kv_pressure`); ``uncached(w)``
are the prompt tokens ``w`` would compute and store. A full pool stores a new prefix by
evicting someone else's, so there every uncached token costs ``kv_pressure`` more.

Session hints (:mod:`.sessions`): the worker that served the session's last turn is its
``session`` worker. The rule: the ledger's exact hit wins (a longer credited prefix
elsewhere outscores the hint); the hint credits the session worker with the previous
turn's prompt blocks this prompt continues (``session_tokens``) while the ledger has not
yet seen them there — the credit is withheld at the high watermark and weighed against load
like every other; and among equal scores the session worker goes first (reason
``session_hit`` when that credit decided, ``session_hint`` when the hint broke a tie).

The degrade chain, in fixed order, reports what the decision could rest on:

* ``exact_kv`` — some READY ledger holds a prefix and the best score has that credit;
* ``load_aware`` — cache data usable but no credited hit (or load outweighed it), every
  candidate's engine load known;
* ``fallback_p2c`` — engine load partly missing: power of two choices on what is known;
* ``fallback_round_robin`` — only liveness known.

The reason says why cache credit was or was not used.

Ties without cache credit (``load_aware``: candidates whose score is within
``tie_tolerance`` active requests of the best, none credited; an idle worker, though, never
ties with a busy one) go to the shortest prefill
queue (``prefilling``: the time to first token a new prompt would wait there); among equal
queues (idle workers, or another replica's view) they are broken by rendezvous
hashing of the prompt's prefix key: every candidate gets the weight
``xxh3_64(prefix_key, seed=xxh3_64(worker_id))`` and the heaviest wins. Every gateway replica
thus sends a new prefix to the same worker without talking to the others (their predicted
blocks are private), and adding or removing one of N workers moves only ~1/N of the
prefixes. The reason is then ``prefix_hash`` unless a degradation (``over_watermark``,
``no_ready_ledger``, ``index_unavailable``, ...) explains the missing credit. Without a
prefix key (a prompt shorter than a block) equal scores go to the shortest prefill queue,
then rotate with ``turn``.

Pure and deterministic given ``turn`` (a counter spreading ties) and ``rng`` (the two p2c
draws).

Prefill/decode pairing (pure): the plan routing hands to the PD dispatcher.
A model is served disaggregated while it has routable ``prefill`` and ``decode`` workers
of its engine. The prefill pool is ranked like regular workers — by cache affinity from the
ledger, then load — because the prefill computes the prompt; the decode pool is ranked by
load only (a decode worker receives the KV, its own cache saves nothing; Dynamo does the
same). The model's ``regular`` workers, if any, are ranked too: the cold fallback.

Conditional disaggregation (vLLM only: an SGLang decode server refuses requests without a
bootstrap room) lets the decode worker prefill itself when the part of the prompt it does
not hold is small; a vLLM request with several sequences (``n > 1``, prompt arrays) always
prefills on the decode worker, since one ``kv_transfer_params`` carries one sequence.

vLLM pairs must run compatible KV connectors: the NIXL handshake refuses a peer whose
compatibility hash differs, and that hash covers the vLLM version and
``NIXL_CONNECTOR_VERSION`` (``kv_connector/v1/nixl/metadata.py``; 15 in 0.33.0, so 0.32 and
0.33 instances cannot be paired). :func:`connector_mismatch` compares the workers' labels
``nixl_connector_version`` and ``engine_version`` (else the version the engine's
``/server_info`` reports); what neither side says is not held against a pair.

**Reuse accounting** (the last section): what prefix cache a routed request could have used,
what the routing captured, what the engine delivered (pure).

* ``available`` — the longest prompt prefix (tokens) any eligible worker held when the
  request was routed: its READY ledger (device, then host / disk tiers), its predicted
  blocks or its session's previous turn, whether or not the decision credited it; per
  tier, ``device`` says how much of it was held in device memory alone when that is less
  (the rest waited in a host / disk tier: a hit the engine pays a load for);
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

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import xxhash

from cortex.gateway.config.gateway import PDConfig, RoutingWeights
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.metrics import GatewayMetrics
from cortex.hashing import Engine
from cortex.ledger.model import LedgerState

__all__ = [
    "CONNECTOR_VERSION_LABEL",
    "ENGINE_VERSION_LABEL",
    "Candidate",
    "Decision",
    "GivenUp",
    "LocalPrefill",
    "MatchMode",
    "PDMode",
    "PDOutcome",
    "PairDecision",
    "Reason",
    "Reuse",
    "Scored",
    "busy",
    "compatible_pair",
    "connector_mismatch",
    "count_reuse",
    "decide",
    "holds_most",
    "kv_pressure",
    "queue_ahead",
    "rendezvous_weight",
    "reuse_of",
]


# ---- scoring ----


class MatchMode(StrEnum):
    """How the decision was made (the ``x-cortex-match-mode`` header)."""

    EXACT_KV = "exact_kv"
    LOAD_AWARE = "load_aware"
    P2C = "fallback_p2c"
    ROUND_ROBIN = "fallback_round_robin"


class Reason(StrEnum):
    """Why cache credit was (or was not) part of the decision."""

    HIT = "hit"
    PREDICTED_HIT = "predicted_hit"
    SESSION_HIT = "session_hit"  # the session's previous turn, not yet in the ledger
    SESSION_HINT = "session_hint"  # no credit anywhere: the session's worker broke a tie
    OFFLOAD_HIT = "offload_hit"  # the credited prefix continues in a host / disk tier
    LOAD_OUTWEIGHS_HIT = "load_outweighs_hit"
    NO_HIT = "no_hit"
    PREFIX_HASH = "prefix_hash"  # no credit anywhere: the prefix's hash broke a load tie
    OVER_WATERMARK = "over_watermark"
    NO_READY_LEDGER = "no_ready_ledger"
    INDEX_UNAVAILABLE = "index_unavailable"
    SHORT_PROMPT = "short_prompt"
    NOT_TOKENIZED = "prompt_not_tokenized"
    LOAD_ONLY = "load_only"  # a decode pool: ranked by load, never by cache


@dataclass(frozen=True, slots=True)
class Candidate:
    """One live worker able to serve the request, with what is known about it.

    ``inflight``: requests this gateway has open on it or has just routed to it.
    ``engine_running`` /
    ``engine_waiting``: the engine's last fresh report (``None`` = unknown or stale).
    ``prefilling``: uncached prompt tokens of this gateway's requests on it that have not
    produced a first byte yet.
    ``index_tokens`` / ``predicted_tokens``: leading prompt tokens held per the index (READY
    sources only, device memory) and per predicted blocks. ``host_tokens`` /
    ``disk_tokens``: tokens the worker's host / disk tiers hold right after its device
    prefix. ``credit_blocked``: why this worker may not get
    cache credit at all (e.g. ``block_size_mismatch``), or ``None``. ``dp_rank``: the DP
    rank holding the credited prefix (``None`` when nothing is held).
    ``session``: it served the request's session's last turn (the hint);
    ``session_tokens``: the leading prompt tokens of that turn this prompt continues.
    ``sessions``: other live agent sessions whose last turn it served. ``kv_pressure``:
    how full its KV pool is past the eviction knee, 0..1 (:func:`kv_pressure`).
    """

    worker_id: str
    inflight: int = 0
    engine_running: int | None = None
    engine_waiting: int | None = None
    high_watermark: int = 64
    prefilling: int = 0
    ledger: LedgerState = LedgerState.UNSPECIFIED
    index_tokens: int = 0
    predicted_tokens: int = 0
    credit_blocked: str | None = None
    dp_rank: int | None = None
    host_tokens: int = 0
    disk_tokens: int = 0
    session: bool = False
    session_tokens: int = 0
    sessions: int = 0
    kv_pressure: float = 0.0

    @property
    def held_tokens(self) -> int:
        """Leading prompt tokens the engine will not compute: its device prefix, then what
        its host and disk tiers hold after it (it loads those back), or the predicted
        blocks, or the session's previous turn, when longer."""
        return max(self.index_tokens + self.host_tokens + self.disk_tokens,
                   self.predicted_tokens, self.session_tokens)

    @property
    def active(self) -> int:
        """Requests running on the worker: the larger of ours and the engine's count."""
        return max(self.inflight, self.engine_running or 0)

    @property
    def queued(self) -> int:
        return self.engine_waiting or 0

    @property
    def load_known(self) -> bool:
        return self.engine_waiting is not None


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate with its credited tokens (the hit predicted: device prefix, then the
    host / disk tokens of tiers with a weight), score and, when credit was withheld, why.
    ``credit``: the credited tokens in device-hit units (tier tokens times their weight)."""

    candidate: Candidate
    credited_tokens: int
    score: float
    note: str = ""
    credit: float = 0.0

    @property
    def worker_id(self) -> str:
        return self.candidate.worker_id


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome: the mode, the reason and every candidate ranked (the chosen one first,
    then the order in which failures before the first byte fall back)."""

    mode: MatchMode
    reason: Reason
    ranked: tuple[Scored, ...]

    @property
    def chosen(self) -> Scored:
        return self.ranked[0]

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens predicted to be cached on the chosen worker."""
        return self.ranked[0].credited_tokens

    def __repr__(self) -> str:
        return (
            f"Decision({self.mode.value}, {self.reason.value}, worker={self.chosen.worker_id},"
            f" hit_tokens={self.hit_tokens}, candidates={len(self.ranked)})"
        )


def _credit(c: Candidate, cache_off: Reason | None, weights: RoutingWeights
            ) -> tuple[int, float, str]:
    """``(tokens, device-hit units, note)`` of a candidate's cache credit."""
    if cache_off is not None:
        return 0, 0.0, cache_off.value
    if c.credit_blocked is not None:
        return 0, 0.0, c.credit_blocked
    if c.ledger is not LedgerState.READY:
        return 0, 0.0, f"ledger_{c.ledger.label}"
    raw = _creditable(c, weights)
    if raw and c.active >= c.high_watermark:
        return 0, 0.0, Reason.OVER_WATERMARK.value
    value = (c.index_tokens + weights.host_hit * c.host_tokens
             + weights.disk_hit * c.disk_tokens)
    return raw, max(value, float(c.predicted_tokens), float(c.session_tokens)), ""


def _creditable(c: Candidate, weights: RoutingWeights) -> int:
    """Leading tokens a candidate could be credited with: its device prefix continued by
    the tiers whose weight is not 0, or its predicted blocks, or its session's previous
    turn."""
    host = c.host_tokens if weights.host_hit else 0
    disk = c.disk_tokens if weights.disk_hit else 0
    return max(c.index_tokens + host + disk, c.predicted_tokens, c.session_tokens)


def busy(c: Candidate, weights: RoutingWeights, new_session: bool = False) -> float:
    """The requests the load term counts on a worker: those running, or its other live
    agent sessions (weighted by ``session``, or ``session_home`` for a session's first turn)
    when more — they are between turns, not gone."""
    per = weights.session_home if new_session else weights.session
    return max(float(c.active), per * c.sessions)


def holds_most(credited: int, prompt_tokens: int, share: float) -> bool:
    """Whether a worker credited with ``credited`` tokens holds at least ``share`` of the
    prompt: then its prefill queue does not count against it (``delta``), only its
    requests do (``beta``, ``gamma``). ``False`` when the prompt's length is unknown (0)."""
    return prompt_tokens > 0 and credited >= share * prompt_tokens


def queue_ahead(c: Candidate, credited: int) -> int:
    """The uncached prompt tokens queued on ``c`` that the request waits for in vain: its
    prefill queue less the blocks it is credited with by prediction only (``credited``
    tokens, beyond the ledger's): a request queued there computes them, and this one
    would have to compute them itself anywhere else (a burst of a new prefix follows its
    first request). A ledger that lags behind a finished prefill leaves the same gap: the
    queue then reads short by at most the credit."""
    if not credited:
        return c.prefilling
    pending = min(credited, c.predicted_tokens) - c.index_tokens
    return c.prefilling - min(max(pending, 0), c.prefilling)


def kv_pressure(blocks: int, capacity: int | None, knee: float) -> float:
    """How full a KV pool of ``capacity`` blocks holding ``blocks`` is past ``knee`` (a
    fraction of it): 0 up to the knee, rising linearly to 1 at full (and past it: the
    ledger may briefly count blocks the engine is about to evict). 0 when the capacity is
    unknown."""
    if not capacity or capacity <= 0:
        return 0.0
    if knee >= 1.0:
        return 1.0 if blocks >= capacity else 0.0
    return min(max((blocks / capacity - knee) / (1.0 - knee), 0.0), 1.0)


@functools.lru_cache(maxsize=4096)
def _worker_seed(worker_id: str) -> int:
    return xxhash.xxh3_64_intdigest(worker_id.encode())


def rendezvous_weight(worker_id: str, prefix_key: int) -> int:
    """The highest-random-weight hash of a worker for a prefix (64-bit, stable across
    processes, Python versions and machines)."""
    data = (prefix_key & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "little")
    return xxhash.xxh3_64_intdigest(data, seed=_worker_seed(worker_id))


def decide(
    candidates: Sequence[Candidate],
    weights: RoutingWeights,
    *,
    cache_off: Reason | None = None,
    turn: int = 0,
    rng: random.Random | None = None,
    prefix_key: int | None = None,
    tie_tolerance: float = 0.0,
    prompt_tokens: int = 0,
    new_session: bool = False,
) -> Decision:
    """Rank ``candidates`` (non-empty) and pick one.

    ``cache_off``: why no candidate may get cache credit for this request (index down,
    prompt not tokenizable, shorter than a block), or ``None``. ``prefix_key``: the block
    key that stands for the prompt's prefix (``None``: no full block); uncredited candidates
    within ``tie_tolerance`` active requests (score units of ``beta``) of the best one are
    ordered by :func:`rendezvous_weight` of it (the session's worker first).
    ``prompt_tokens``: the prompt's length, for the KV-pressure term (0: no such term).
    ``new_session``: the request starts a session (its live-session weight is
    ``session_home``).
    """
    if not candidates:
        raise ValueError("decide() needs at least one candidate")
    n = len(candidates)
    scored: list[tuple[Scored, int]] = []
    for i, c in enumerate(candidates):
        tokens, credit, note = _credit(c, cache_off, weights)
        score = (weights.alpha * credit - weights.beta * busy(c, weights, new_session)
                 - weights.gamma * c.queued)
        if weights.delta and not holds_most(tokens, prompt_tokens, weights.delta_hit_share):
            score -= weights.delta * queue_ahead(c, tokens)
        if c.kv_pressure and prompt_tokens:
            uncached = max(prompt_tokens - c.held_tokens, 0)
            score -= weights.kv_pressure * c.kv_pressure * uncached
        scored.append((Scored(c, tokens, score, note, credit), (i - turn) % n))

    def by_score(item: tuple[Scored, int]) -> tuple[float, bool, int, int, int]:
        s, rotation = item
        c = s.candidate
        return (-s.score, not c.session, c.prefilling, c.active, rotation)

    band = weights.beta * tie_tolerance
    if any(s.credited_tokens for s, _ in scored):
        ranked = tuple(s for s, _ in sorted(scored, key=by_score))
        best = ranked[0]
        if best.credited_tokens:
            c = best.candidate
            if c.session_tokens >= best.credited_tokens > max(c.index_tokens + c.host_tokens
                                                              + c.disk_tokens,
                                                              c.predicted_tokens):
                reason = Reason.SESSION_HIT
            elif c.predicted_tokens >= best.credited_tokens > c.index_tokens:
                reason = Reason.PREDICTED_HIT
            elif best.credited_tokens > c.index_tokens:
                reason = Reason.OFFLOAD_HIT
            else:
                reason = Reason.HIT
            return Decision(MatchMode.EXACT_KV, reason, ranked)
        if prefix_key is not None:
            ranked, _ = _break_tie(ranked, prefix_key, band)
        return Decision(MatchMode.LOAD_AWARE, Reason.LOAD_OUTWEIGHS_HIT, ranked)

    reason = cache_off or _no_credit_reason(candidates, weights)
    if all(c.load_known for c in candidates):
        ranked = tuple(s for s, _ in sorted(scored, key=by_score))
        if prefix_key is not None:
            ranked, hashed = _break_tie(ranked, prefix_key, band)
            if hashed and reason is Reason.NO_HIT:
                reason = Reason.PREFIX_HASH
        if ranked[0].candidate.session and reason in (Reason.NO_HIT, Reason.PREFIX_HASH):
            reason = Reason.SESSION_HINT
        return Decision(MatchMode.LOAD_AWARE, reason, ranked)
    under = [item for item in scored if item[0].candidate.active < item[0].candidate.high_watermark]
    pool = under or scored
    if any(c.load_known for c in candidates):
        return Decision(MatchMode.P2C, reason, _p2c(pool, scored, rng or random.Random()))
    rotation = sorted(scored, key=lambda item: (item not in pool, item[1]))
    return Decision(MatchMode.ROUND_ROBIN, reason, tuple(s for s, _ in rotation))


def _break_tie(ranked: tuple[Scored, ...], prefix_key: int, band: float
               ) -> tuple[tuple[Scored, ...], bool]:
    """``ranked`` with its uncredited candidates within ``band`` of the best score moved to
    the front, the shortest prefill queue first and rendezvous order among equal queues;
    ``True`` when there were several to choose from; the session's worker, if tied, goes
    first. A worker at its high watermark never ties with one below it, nor a worker whose
    KV pool is filling up with one that has room: the hash must not undo shedding. Nor does
    a busy worker tie with an idle one: a prompt nobody holds starts at once there, where
    it would share the other's steps (and, on a CPU engine, its core)."""
    top = ranked[0]
    best, under = top.score, _under_watermark(top.candidate)
    roomy = not top.candidate.kv_pressure
    tied = [s for s in ranked if not s.credited_tokens and best - s.score <= band
            and (_under_watermark(s.candidate) or not under)
            and (not s.candidate.kv_pressure or not roomy)]
    if any(_idle(s.candidate) for s in tied):
        tied = [s for s in tied if _idle(s.candidate)]
    tied.sort(key=lambda s: (not s.candidate.session, s.candidate.prefilling,
                             -rendezvous_weight(s.worker_id, prefix_key)))
    chosen = {id(s) for s in tied}
    return (*tied, *(s for s in ranked if id(s) not in chosen)), len(tied) > 1


def _idle(c: Candidate) -> bool:
    """Nothing running there, as far as this gateway and the engine's last report know
    (agent sessions between turns weigh in the score, as their weights say)."""
    return c.active == 0


def _under_watermark(c: Candidate) -> bool:
    return c.active < c.high_watermark


def _no_credit_reason(candidates: Sequence[Candidate], weights: RoutingWeights) -> Reason:
    ready = [c for c in candidates if c.ledger is LedgerState.READY and c.credit_blocked is None]
    if not ready:
        return Reason.NO_READY_LEDGER
    if any(_creditable(c, weights) for c in ready):
        return Reason.OVER_WATERMARK
    return Reason.NO_HIT


def _p2c(
    pool: list[tuple[Scored, int]], everyone: list[tuple[Scored, int]], rng: random.Random
) -> tuple[Scored, ...]:
    def load(s: Scored) -> int:
        return s.candidate.active + s.candidate.queued

    picks = [s for s, _ in rng.sample(pool, min(2, len(pool)))]
    picks.sort(key=load)
    rest = sorted((s for s, _ in everyone if s not in picks), key=load)
    return (*picks, *rest)


# ---- pairing ----


CONNECTOR_VERSION_LABEL = "nixl_connector_version"
ENGINE_VERSION_LABEL = "engine_version"


def _engine_version(worker: WorkerState) -> str | None:
    return worker.spec.labels.get(ENGINE_VERSION_LABEL) or worker.engine_version


def connector_mismatch(prefill: WorkerState, decode: WorkerState) -> str | None:
    """Why a vLLM prefill and decode worker cannot hand KV over (``None``: they can, as far
    as both say)."""
    if prefill.spec.engine is not Engine.VLLM:
        return None
    ours = prefill.spec.labels.get(CONNECTOR_VERSION_LABEL)
    theirs = decode.spec.labels.get(CONNECTOR_VERSION_LABEL)
    if ours and theirs and ours != theirs:
        return (f"NIXL connector version {ours} on prefill {prefill.id} and {theirs} on"
                f" decode {decode.id}")
    ours, theirs = _engine_version(prefill), _engine_version(decode)
    if ours and theirs and ours != theirs:
        return f"vLLM {ours} on prefill {prefill.id} and {theirs} on decode {decode.id}"
    return None


Ranked = Sequence[tuple[Scored, WorkerState]]


def compatible_pair(prefills: Ranked, decodes: Ranked
                    ) -> tuple[tuple[Scored, Scored] | None, list[tuple[str, str, str]]]:
    """The first (prefill, decode) in rank order whose connectors can talk, and the pairs
    refused on the way as ``(prefill id, decode id, why)``."""
    refused: list[tuple[str, str, str]] = []
    if not decodes:
        return None, refused
    for prefill, p_worker in prefills:
        for decode, d_worker in decodes:
            why = connector_mismatch(p_worker, d_worker)
            if why is None:
                return (prefill, decode), refused
            refused.append((p_worker.id, d_worker.id, why))
    return None, refused


class PDMode(StrEnum):
    """How a PD model's request was served (the ``x-cortex-pd`` header)."""

    DISAGGREGATED = "disaggregated"
    LOCAL_PREFILL = "local_prefill"
    FALLBACK = "fallback_regular"


class LocalPrefill(StrEnum):
    """Why the decode worker prefills itself."""

    SHORT_UNCACHED = "short_uncached"
    MULTI_SEQUENCE = "multi_sequence"


@dataclass(frozen=True, slots=True)
class PDOutcome:
    """What served a PD request: the mode and the workers (``None`` for a fallback)."""

    mode: PDMode
    prefill: str | None
    decode: str | None


@dataclass(frozen=True, slots=True)
class PairDecision:
    """A PD routing outcome. ``prefill`` (ledger affinity) is the request's main decision;
    ``decode`` is ranked by load (reason ``load_only``); ``fallback`` ranks the model's
    regular workers (``None``: it has none). ``sequences``: prompts x ``n``."""

    engine: Engine
    prefill: Decision
    decode: Decision
    fallback: Decision | None
    prompt_tokens: int
    sequences: int

    @staticmethod
    def held_tokens(scored: Scored) -> int:
        """Leading prompt tokens a worker holds per its READY ledger or predictions (also
        when the decision gave it no credit)."""
        c = scored.candidate
        if c.ledger is not LedgerState.READY or c.credit_blocked is not None:
            return 0
        return c.held_tokens

    def local_prefill(self, decode: Scored, config: PDConfig) -> LocalPrefill | None:
        """Whether ``decode`` should prefill itself instead of a remote prefill."""
        if self.engine is not Engine.VLLM:
            return None
        if self.sequences > 1:
            return LocalPrefill.MULTI_SEQUENCE
        if not config.local_prefill_max_tokens or self.prompt_tokens <= 0:
            return None
        uncached = max(self.prompt_tokens - self.held_tokens(decode), 0)
        if (uncached < config.local_prefill_max_tokens
                and uncached <= config.local_prefill_max_ratio * self.prompt_tokens):
            return LocalPrefill.SHORT_UNCACHED
        return None

    def computes(self, prefill: Scored, decode: Scored, config: PDConfig
                 ) -> tuple[Scored, LocalPrefill | None]:
        """Which worker of the pair computes the prompt (where its predicted blocks go), and
        why it is the decode worker itself when it is (a local prefill: no prefill leg)."""
        local = self.local_prefill(decode, config)
        return (decode if local is not None else prefill), local

    def __repr__(self) -> str:
        fallback = self.fallback.chosen.worker_id if self.fallback else None
        return (f"PairDecision({self.engine.value}, prefill={self.prefill.chosen.worker_id},"
                f" decode={self.decode.chosen.worker_id}, fallback={fallback})")


# ---- reuse accounting ----


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
    device: int | None = None
    """Per tier: the longest prefix any eligible worker held in device memory, when that is
    less than ``available`` (the rest of the longest prefix sat in a host / disk tier, which
    the engine loads back); ``None`` when ``available`` was all on device."""

    @property
    def lost(self) -> int:
        """Tokens the decision gave up (``available - captured``)."""
        return self.available - self.captured

    def with_delivered(self, delivered: int | None) -> Reuse:
        return replace(self, delivered=delivered)

    def header(self) -> bytes:
        """The ``x-cortex-reuse`` header value: ``available=A; captured=C; given_up=R``,
        then ``; available_device=V`` when part of ``A`` was in a host / disk tier, then
        ``; delivered=D`` once known."""
        text = f"available={self.available}; captured={self.captured}; given_up={self.given_up}"
        if self.device is not None:
            text += f"; available_device={self.device}"
        if self.delivered is not None:
            text += f"; delivered={self.delivered}"
        return text.encode()

    def log_fields(self) -> dict[str, int | str | None]:
        """The access log's fields."""
        return {"reuse_available": self.available, "reuse_captured": self.captured,
                "reuse_given_up": self.given_up, "reuse_delivered": self.delivered,
                "reuse_available_device": self.available if self.device is None
                else self.device}


def reuse_of(decision: Decision, worker_id: str, unranked: int | None = None) -> Reuse:
    """``available`` and ``captured`` of ``decision`` when ``worker_id`` serves the request
    (the decision's choice, or a fallback after it failed). ``unranked``: what
    ``worker_id`` holds when the decision did not rank it (a PD decode worker prefilling
    itself: its credited hit)."""
    ranked = any(s.worker_id == worker_id for s in decision.ranked)
    captured = unranked if unranked is not None and not ranked else 0
    available, best, device = captured, None, 0
    for scored in decision.ranked:
        held = PairDecision.held_tokens(scored)
        if held > available:
            available, best = held, scored
        if scored.worker_id == worker_id:
            captured = held
        if held > device:
            c = scored.candidate
            device = max(device, min(held, max(c.index_tokens, c.predicted_tokens,
                                                c.session_tokens)))
    tiers = device if device < available and best is not None else None
    if captured >= available or best is None:
        return Reuse(available, captured, device=tiers)
    if best.note:
        why = best.note
    elif worker_id != decision.chosen.worker_id:
        why = GivenUp.RETRY
    elif best.candidate.kv_pressure > 0:
        why = GivenUp.KV_PRESSURE
    else:
        why = GivenUp.LOAD
    return Reuse(available, captured, why, device=tiers)


def count_reuse(metrics: GatewayMetrics, model: str, worker_id: str, reuse: Reuse,
                prompt_tokens: int) -> None:
    """Count an answered request's reuse: the three totals only when the engine said what
    it delivered (so that they compare), else it is counted as unreported."""
    if reuse.delivered is None:
        metrics.child(metrics.reuse_unreported, model).inc()
        return
    tokens = metrics.reuse_tokens
    metrics.worker(tokens, worker_id, model, "available").inc(reuse.available)
    metrics.worker(tokens, worker_id, model, "available_device").inc(
        reuse.available if reuse.device is None else reuse.device)
    metrics.worker(tokens, worker_id, model, "captured").inc(reuse.captured)
    metrics.worker(tokens, worker_id, model, "delivered").inc(reuse.delivered)
    metrics.worker(metrics.reuse_prompt_tokens, worker_id, model).inc(prompt_tokens)
    if reuse.lost:
        metrics.child(metrics.reuse_given_up, model, reuse.given_up).inc(reuse.lost)
