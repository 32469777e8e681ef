"""Routing: request → exact prompt tokens → block keys → ledger match (the in-process replica;
the index over gRPC while the replica is not usable) → predicted blocks → scoring →
:class:`Routed`. The only awaits are tokenizing long prompts and the fallback Match.

Hit accounting follows the engines: a request whose prompt is fully cached still computes
its last token, so at most ``(prompt_tokens - 1) // block_size`` blocks can be hits; the
query sent to the index is cut there, while predictions credit every full block (the
engine caches them all once the prompt is processed).

Speculative decoding: a worker whose spec has ``kv_lookahead`` L > 0 (vLLM EAGLE lookahead
block hashes, SGLang EAGLE bigram pages; for SGLang also learned from ``/server_info``) holds
lookahead keys, which cover each block's next
L tokens (:func:`cortex.hashing.lookahead_block_keys`): the prompt is keyed once per L its
candidates run and each worker is matched, predicted and credited with its own key set
(keys of different sets never collide, so a worker matches nothing under another's). Only
blocks whose next L tokens are in the prompt are keyed: the engine cannot reuse the others.
A worker with ``kv_eagle_drop`` (vLLM EAGLE on legacy hashes) is credited one block less
than it holds: its lookup drops the last block it matched.

A recorded decision takes effect at once, before the request is dispatched: the worker
that will compute the prompt is credited with its blocks (predicted blocks) and counted as
one more active request (``WorkerState.pending``), so requests routed a moment later —
a simultaneous burst of one new prefix — follow it, and stop following it at its high
watermark. The :class:`Placement` in :class:`Routed` lets dispatch move that credit when a
failure before the first byte sends the request elsewhere.

A routing outcome (:class:`Routed`) and the time each routing stage took (pure values).

What a recorded routing decision adds to the metrics: the observer the router calls
once per decision it records (explain records nothing).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from cortex.gateway.config.gateway import GatewayConfig, ModelConfig, TokenizeConfig
from cortex.gateway.dispatch.pd.handoff import sequence_count
from cortex.gateway.errors import ClientError, ServiceUnavailable
from cortex.gateway.fleet.pool import Eligible, WorkerPool, WorkerState
from cortex.gateway.ledger.replica_client import (
    WorkerMatch,
    fold_sources,
    merge_matches,
    walk_depth,
)
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferenceRequest
from cortex.gateway.routing.media import media_keys, sized_items
from cortex.gateway.routing.placement import (
    AgentTerms,
    BlocksOf,
    Placement,
    PredictedBlocks,
    RequestTerms,
    WalkedPredictions,
)
from cortex.gateway.routing.scoring import Candidate, Decision, PairDecision, Reason, Scored, decide
from cortex.gateway.tokens.prompt import Encoded, PromptTokenizer, Walk, keys_past
from cortex.gateway.tokens.service import Tokenization
from cortex.gateway.upstream.images import ImageHeaders
from cortex.hashing import Engine, HashDomain
from cortex.ledger.match import Match
from cortex.ledger.model import LedgerState, Source, Tier
from cortex.ledger.replica import LedgerReplica, ReplicaChanges

__all__ = [
    "OFFLOAD_CHARS",
    "TIE_BLOCKS",
    "TIE_TOLERANCE",
    "Matcher",
    "Routed",
    "Router",
    "RoutingMetrics",
    "StageTimings",
    "lookahead_blocks",
    "uncached",
]


# ---- routed ----


@dataclass(frozen=True, slots=True)
class StageTimings:
    """Seconds spent per routing stage (wall time), and ``cpu``: the CPU seconds the
    decision took on its thread (wall minus it is waiting: for the GIL, for a core; read
    for explain only: the thread's CPU clock is a system call, twice per request)."""

    tokenize: float
    hash: float
    match: float
    score: float
    cpu: float = 0.0

    @property
    def total(self) -> float:
        return self.tokenize + self.hash + self.match + self.score


@dataclass(frozen=True, slots=True)
class Routed:
    """A routing outcome: the decision plus what it was computed from. For a model served
    disaggregated, ``pd`` is the pair plan and ``decision`` its prefill ranking.
    ``placement``: the decision's credit and counted load (dispatch moves them)."""

    decision: Decision
    model: ModelConfig
    prompt_tokens: int
    keys: list[int]  # every full block of the prompt (plain keys)
    query_blocks: int  # blocks that could be hits (matched against the ledger)
    match_source: str  # "replica" | "index" | "none"
    index_version: int
    timings: StageTimings
    placement: Placement
    pd: PairDecision | None = None
    keysets: Mapping[int, list[int]] | None = None  # lookahead L > 0 -> the prompt's keys
    agents: RequestTerms | None = None  # the session hint and the agent terms it was scored with

    def credited_tokens(self, worker_id: str) -> int:
        """Hit tokens predicted for ``worker_id`` (a fallback may differ from the choice)."""
        for scored in self.decision.ranked:
            if scored.worker_id == worker_id:
                return scored.credited_tokens
        return 0


def uncached(prompt_tokens: int, scored: Scored) -> int:
    """Prompt tokens ``scored``'s worker will compute (what it holds is not computed, even
    when the decision gave it no credit for it)."""
    return max(prompt_tokens - PairDecision.held_tokens(scored), 0)


# ---- observer ----


class RoutingMetrics:
    """Stage timings (seconds), the decision's mode and reason, the prompt's size (tokens)."""

    __slots__ = ("_metrics",)

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def __call__(self, routed: Routed) -> None:
        m, timings, decision = self._metrics, routed.timings, routed.decision
        stage = m.routing_seconds
        m.child(stage, "tokenize").observe(timings.tokenize)
        m.child(stage, "hash").observe(timings.hash)
        m.child(stage, "match").observe(timings.match)
        m.child(stage, "score").observe(timings.score)
        m.child(stage, "total").observe(timings.total)
        m.child(m.decisions, decision.mode.value, decision.reason.value).inc()
        m.prompt_tokens.observe(routed.prompt_tokens)


# ---- router ----


OFFLOAD_CHARS = TokenizeConfig().offload_chars
"""The default ``tokenize.offload_chars``: uncached prompt text (characters, ~1k tokens,
1-6 ms of encoding) above which encoding leaves the event loop."""

TIE_TOLERANCE = 1.0
"""Workers without cache credit whose load is within this many active requests of the least
loaded one tie: each replica sees its own requests at once and the others' only through the
engines' polled load, so exact ties would rarely survive across replicas."""

TIE_BLOCKS = 4  # <= tokens.lazy.MIN_NEW_BLOCKS: a lazy walk has this key
"""Ties go to the rendezvous hash of the block key of the prompt's first this many blocks
(64 tokens at block size 16): deep enough to tell different prompts apart, shallow enough to
lie inside a shared system prompt."""

log = logging.getLogger(__name__)


class Matcher(Protocol):
    """What routing needs from the index client (an in-memory one serves unit tests)."""

    @property
    def available(self) -> bool: ...

    async def match(self, domain: HashDomain, keys: list[int], deadline: float
                    ) -> Match | None: ...


class Replica(Protocol):
    """What routing needs from the ledger replica's owner (``ReplicaClient``)."""

    @property
    def usable(self) -> bool: ...

    @property
    def replica(self) -> LedgerReplica: ...


def lookahead_blocks(model: ModelConfig, prompt_tokens: int, lookahead: int) -> int:
    """Leading lookahead blocks of a prompt the engine can reuse. vLLM: every block whose
    next ``lookahead`` tokens are in the prompt (``get_request_block_hasher`` hashes no other;
    the ``prompt - 1`` cap is then implied). SGLang EAGLE: the match key is the prompt minus
    its last token (``Req._compute_max_prefix_len``) seen as bigrams, one fewer than its
    tokens (``RadixKey.__len__``): pages ending at least two tokens before the prompt's end.
    """
    margin = lookahead + (1 if model.engine is Engine.SGLANG else 0)
    return max(prompt_tokens - margin, 0) // model.block_size


def _unavailable(req: InferenceRequest) -> ServiceUnavailable:
    model = req.model
    if req.adapter is not None:
        return ServiceUnavailable(f"no available worker serves the adapter '{req.adapter}' "
                                  f"of model '{model.name}'")
    return ServiceUnavailable(f"no available worker for model '{model.name}'")


@dataclass(frozen=True, slots=True)
class _Ledger:
    """What routing takes from the ledger for one prompt: per worker its best match, the
    predicted blocks, why cache credit is off (``None``: it is on), where the match came
    from and the ledger version it reflects."""

    folded: dict[str, WorkerMatch]
    predicted: dict[str, int]
    cache_off: Reason | None
    source: str
    version: int


class Router:
    """Holds the routing caches; one per gateway process. Not thread-safe (event loop)."""

    def __init__(
        self,
        config: GatewayConfig,
        pool: WorkerPool,
        tokenizers: Mapping[str, PromptTokenizer],
        matcher: Matcher | None,
        metrics: GatewayMetrics,
        replica: Replica | None = None,
        observer: Callable[[Routed], None] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.tokenizers = tokenizers
        self.matcher = matcher
        self.replica = replica
        self.metrics = metrics
        self.observer = observer or RoutingMetrics(metrics)
        routing = config.routing
        self.predicted = PredictedBlocks(routing.predicted_ttl_s, routing.predicted_max_keys)
        self._turn = 0
        self._rng = random.Random()
        self.tokenization = Tokenization(config, tokenizers, metrics)
        self.agents = AgentTerms(routing, metrics)
        self.image_headers: ImageHeaders | None = None
        """Reads URL images' headers (set by the runtime where a model asks for it)."""
        self._open_walks: dict[int, asyncio.Future[Sequence[int]]] = {}
        """A recorded walk's last key → the encoding of its prompt's rest (:meth:`_follow`)."""

    # ---- tokens ----

    async def tokens(self, req: InferenceRequest) -> Encoded:
        """The exact prompt token ids the engine will see, and the heads that key them
        (:meth:`Tokenization.tokens`).
        Raises :class:`ClientError` for a prompt the engine would reject."""
        return await self.tokenization.tokens(req)

    def close(self) -> None:
        """Stop the tokenizer workers (waits for running encodes)."""
        self.tokenization.close()

    # ---- routing ----

    async def route(self, req: InferenceRequest, deadline: float, *, record: bool = True,
                    allowed: Collection[str] | None = None, session: str | None = None
                    ) -> Routed:
        """Tokenize, hash, match and score. ``deadline``: ``time.monotonic()`` seconds.

        Raises :class:`ClientError` (bad prompt) or :class:`ServiceUnavailable` (no
        routable worker). ``record=False`` (explain) leaves metrics and counters alone.
        ``allowed``: only these worker ids may be chosen (an endpoint picker's subset).
        ``session``: the session the request names (:func:`~.sessions.session_of`).
        """
        model = req.model
        t0, cpu0 = time.perf_counter(), 0.0 if record else time.thread_time()
        eligible = self.pool.eligible(model, req.adapter, allowed, pd=self.config.pd.enabled)
        lazy, walked = await self._follow(req, eligible, session,
                                          self._walk(req, eligible, session), deadline)
        try:
            prompt: Walk | Encoded = lazy if lazy is not None else await self.tokens(req)
        except ClientError:
            if not req.prompt.media:
                raise
            prompt = Encoded([])  # a template that cannot render these media: the engine decides
        ids = prompt.ids
        t1 = time.perf_counter()
        if req.prompt.media:
            items = await sized_items(req, self.image_headers, deadline)
            keys, query_blocks, prompt_tokens = await media_keys(
                req, ids, lambda args: self.tokenization.chat_tokens(model, args), items)
        else:
            keys, query_blocks, prompt_tokens = self._keyed(req, prompt)
        t2 = time.perf_counter()
        if not eligible.regular and eligible.pairs is None:
            raise _unavailable(req)
        keysets = ({} if req.prompt.media  # no lookahead keys for media: no credit there
                   else self._lookahead_keys(model, ids, req, eligible.everyone()))
        ledger = await self._ledger(model, prompt_tokens, keys[:query_blocks], keysets,
                                    deadline, walked)
        t3 = time.perf_counter()
        if record:
            self._turn += 1
        agents = self.agents.request(model.name, model.block_size, session, keys,
                                     query_blocks, self._blocks_of())
        plan = self._decide(req, prompt_tokens, keys, ledger, eligible, agents)
        decision = plan if isinstance(plan, Decision) else plan.prefill
        placement = self.placement(keys, keysets)
        if record and lazy is not None and not lazy.complete:
            # a small rest is encoded now (a thread hop would cost more): the placement and
            # the held prefill tokens are exact from the start
            if self.tokenization.finish_small(model.name, lazy) is not None:
                keys, query_blocks, prompt_tokens = self._keyed(req, lazy)
                placement.keys = keys
        if record:
            self._take_effect(placement, plan, prompt_tokens)
            agents.routed(decision.chosen.worker_id)
        timings = StageTimings(t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3,
                               0.0 if record else time.thread_time() - cpu0)
        keys, query_blocks, prompt_tokens = self._rest_of_walk(
            req, lazy, placement, record, (keys, query_blocks, prompt_tokens))
        routed = Routed(decision, model, prompt_tokens, keys, query_blocks, ledger.source,
                        ledger.version, timings, placement,
                        None if isinstance(plan, Decision) else plan, keysets, agents)
        if record:
            self.observer(routed)
        return routed

    def _keyed(self, req: InferenceRequest, prompt: Walk | Encoded
               ) -> tuple[list[int], int, int]:
        """``(keys, query_blocks, prompt_tokens)`` of the prompt, walked or encoded whole:
        its full blocks' keys, those that could be hits, its length (estimated while the
        prompt goes on past the walk: then every walked block could be a hit)."""
        model = req.model
        if isinstance(prompt, Encoded):
            keys = prompt.chain(model.domain.root_key(req.lora_name, req.cache_salt),
                                model.block_size)
        elif prompt.complete:
            keys = prompt.keys
        else:
            return (prompt.keys, len(prompt.keys),
                    prompt.estimated_tokens(self.tokenization.ratios[model.name]))
        tokens = len(prompt.ids)
        return keys, max(tokens - 1, 0) // model.block_size, tokens

    def _rest_of_walk(self, req: InferenceRequest, lazy: Walk | None, placement: Placement,
                      record: bool, keyed: tuple[list[int], int, int]
                      ) -> tuple[list[int], int, int]:
        """The prompt past its walk: recorded, the rest is tokenized off the request path
        (the credit then covers every block); explain reports the exact length and keys
        (outside its timings). ``keyed``: what :meth:`_keyed` said of the walk."""
        if lazy is None or lazy.complete:
            return keyed
        if record:
            self._finish_later(req, lazy, placement)
            return keyed
        lazy.finish(self.tokenizers[req.model.name], keyed=True)
        keyed = self._keyed(req, lazy)
        placement.keys = keyed[0]
        return keyed

    def _walk(self, req: InferenceRequest, eligible: Eligible, session: str | None
              ) -> tuple[Walk | None, WalkedPredictions | None]:
        """The lazy walk of ``req``'s prompt (``tokenize.lazy``) and the predictions it
        asked about, or ``None`` where the whole ids are needed or the match is not in
        process: PD (the pair's split reads the exact length), workers with lookahead keys,
        the ledger over gRPC. A session's walk goes at least as deep as its last turn (the
        ledger may not have seen it)."""
        replica = self.replica
        if (not self.config.tokenize.lazy or eligible.pairs is not None or replica is None
                or req.prompt.media
                or not replica.usable or any(w.kv_lookahead for w in eligible.everyone())):
            return None, None
        domain = req.model.domain
        walked = WalkedPredictions(self.predicted)
        deepest = walk_depth(replica.replica, domain, self.predicted.match, walked.runs)
        turn = self.agents.table.blocks(req.model.name, session) if session is not None else 0
        if turn:
            held = deepest

            def deepest(keys: list[int]) -> int:
                return max(held(keys), turn)

        lazy = self.tokenization.walk(req, domain.root_key(req.lora_name, req.cache_salt),
                                      deepest)
        return lazy, walked if lazy is not None else None

    async def _follow(self, req: InferenceRequest, eligible: Eligible, session: str | None,
                      walked: tuple[Walk | None, WalkedPredictions | None], deadline: float
                      ) -> tuple[Walk | None, WalkedPredictions | None]:
        """A walk that stopped where a recorded walk ends whose rest is still being encoded
        (a burst of one new prompt: the first request was routed on its first blocks) waits
        for that rest, at most ``tokenize.follow_ms``, and walks again: the first request's
        credit then covers its whole prompt, so this one is credited as far as the two
        prompts agree instead of with the first blocks only."""
        lazy = walked[0]
        if lazy is None or lazy.complete or not lazy.deepest:
            return walked
        rest = self._open_walks.get(lazy.keys[lazy.deepest - 1])
        timeout = min(self.config.tokenize.follow_ms / 1000, deadline - time.monotonic())
        if rest is None or timeout <= 0:
            return walked
        await asyncio.wait([rest], timeout=timeout)  # never cancels the rest
        m = self.metrics
        m.child(m.tokenize_lazy_follow, req.model.name,
                "followed" if rest.done() else "timeout").inc()
        return self._walk(req, eligible, session) if rest.done() else walked

    def _finish_later(self, req: InferenceRequest, lazy: Walk, placement: Placement) -> None:
        """Encode the rest of a walked prompt off the request path; once done, the
        placement credits every block (until then, or if shed, the walked ones). Until
        then a walk ending at the same last key waits for it (:meth:`_follow`)."""
        pending = self.tokenization.finish_later(req.model.name, lazy)
        if pending is None:
            return
        future = asyncio.wrap_future(pending)
        domain = req.model.domain
        root = domain.root_key(req.lora_name, req.cache_salt)
        tail = lazy.keys[-1] if lazy.keys else None
        if tail is not None:
            self._open_walks[tail] = future

        def finished(done: asyncio.Future[Sequence[int]]) -> None:
            if tail is not None and self._open_walks.get(tail) is done:
                del self._open_walks[tail]
            if done.cancelled() or done.exception() is not None:
                return
            walked = placement.keys  # the rest's keys chain on from the walked ones
            placement.complete(walked + keys_past(walked, done.result(), domain.block_size,
                                                  root))

        future.add_done_callback(finished)  # before any follower's wake-up: credit first

    async def _ledger(self, model: ModelConfig, prompt_tokens: int, query: list[int],
                      keysets: Mapping[int, list[int]], deadline: float,
                      walked: WalkedPredictions | None = None) -> _Ledger:
        """What the ledger and the predictions say of the prompt: the match of its plain
        keys merged with that of each lookahead key set, and the predicted blocks (those of
        the walk's keys as the walk found them, when ``walked`` and still current)."""
        answer, source = await self._match(model, query, deadline)
        predicted = ({} if answer is None else walked.match(query) if walked is not None
                     else self.predicted.match(query))
        for lookahead, lookahead_keys in keysets.items():
            lookahead_query = lookahead_keys[:lookahead_blocks(model, prompt_tokens, lookahead)]
            extra, _ = await self._match(model, lookahead_query, deadline)
            answer = merge_matches(answer, extra)
            if answer is not None:
                for worker_id, blocks in self.predicted.match(lookahead_query).items():
                    predicted[worker_id] = max(blocks, predicted.get(worker_id, 0))
        cache_off = (Reason.SHORT_PROMPT if not query
                     else Reason.INDEX_UNAVAILABLE if answer is None else None)
        folded = fold_sources(answer.sources) if answer is not None else {}
        return _Ledger(folded, predicted, cache_off, source,
                       answer.version if answer is not None else 0)

    def _decide(self, req: InferenceRequest, prompt_tokens: int, keys: list[int],
                ledger: _Ledger, eligible: Eligible, agents: RequestTerms
                ) -> Decision | PairDecision:
        """Score the eligible workers: the regular decision, or the pair plan (its prefill
        ranked like a regular request, its decode by load) with the regular one as its
        fallback."""
        model = req.model
        weights, turn, rng = self.config.routing.weights, self._turn, self._rng
        prefix_key = keys[min(TIE_BLOCKS, len(keys)) - 1] if keys else None

        def candidates(workers: list[WorkerState]) -> list[Candidate]:
            return [self._candidate(w, model, ledger.folded.get(w.id),
                                    ledger.predicted.get(w.id, 0), agents) for w in workers]

        def by_cache(workers: list[WorkerState]) -> Decision:
            return decide(candidates(workers), weights, cache_off=ledger.cache_off, turn=turn,
                          rng=rng, prefix_key=prefix_key, tie_tolerance=TIE_TOLERANCE,
                          prompt_tokens=prompt_tokens, new_session=agents.new_session)

        regular = by_cache(eligible.regular) if eligible.regular else None
        if eligible.pairs is None:
            assert regular is not None
            return regular
        prefill, decode = eligible.pairs
        return PairDecision(model.engine, by_cache(prefill),
                            decide(candidates(decode), weights, cache_off=Reason.LOAD_ONLY,
                                   turn=turn, rng=rng),
                            regular, prompt_tokens, sequence_count(req.endpoint, req.body))

    def _take_effect(self, placement: Placement, plan: Decision | PairDecision,
                     prompt_tokens: int) -> None:
        """A recorded decision takes effect now: the worker that computes the prompt is
        credited and counted; a pair's decode worker is counted too (unless the decode
        computes the prompt itself)."""
        if isinstance(plan, Decision):
            chosen = plan.chosen
            self._place(placement, chosen.worker_id, uncached(prompt_tokens, chosen))
            return
        d_worker = self.pool.get(plan.decode.chosen.worker_id)
        computes, why = plan.computes(plan.prefill.chosen, plan.decode.chosen, self.config.pd)
        self._place(placement, computes.worker_id, uncached(prompt_tokens, computes))
        if d_worker is not None and why is None:
            placement.hold(d_worker)

    @staticmethod
    def _lookahead_keys(model: ModelConfig, ids: Sequence[int], req: InferenceRequest,
                        everyone: list[WorkerState]) -> dict[int, list[int]]:
        """The prompt's lookahead keys (every block the engine caches once it has the
        prompt), per lookahead the candidates run; none for plain workers only."""
        wanted = {w.kv_lookahead for w in everyone if w.kv_lookahead > 0}
        return {lookahead: model.domain.keys(ids, req.lora_name, req.cache_salt,
                                             lookahead=lookahead)
                for lookahead in sorted(wanted)}

    def keys_for(self, worker_id: str, keys: list[int],
                 keysets: Mapping[int, list[int]] | None) -> list[int]:
        """The prompt's keys in ``worker_id``'s key set: plain ``keys``, or its lookahead
        keys (none when they were not computed: crediting plain ones would over-predict)."""
        worker = self.pool.get(worker_id)
        lookahead = worker.kv_lookahead if worker is not None else 0
        if not lookahead:
            return keys
        return (keysets or {}).get(lookahead, [])

    def _place(self, placement: Placement, worker_id: str, prefill_tokens: int) -> None:
        """The decision takes effect now: credit ``worker_id`` and count the request (and
        the ``prefill_tokens`` it will compute) there."""
        placement.move(worker_id)
        worker = self.pool.get(worker_id)
        if worker is not None:
            placement.hold(worker, prefill_tokens)

    def placement(self, keys: list[int], keysets: Mapping[int, list[int]] | None = None
                  ) -> Placement:
        """An empty placement for ``keys`` (a fallback that places the request anew)."""
        return Placement(self.predicted, self.keys_for, self.metrics, keys, keysets)

    def commit(self, routed: Routed, worker_id: str) -> None:
        """``worker_id`` caches the prompt's blocks too (a vLLM decode pulled them): predict
        them there, besides the request's placement."""
        self.predicted.credit(worker_id, self.keys_for(worker_id, routed.keys, routed.keysets))
        self.metrics.predicted_keys.set(len(self.predicted))

    async def _match(self, model: ModelConfig, query: list[int], deadline: float
                     ) -> tuple[Match | None, str]:
        """The ledger's answer and where it came from: the in-process replica while it is
        usable (no I/O), else the index over gRPC (bounded by ``deadline``), else none."""
        if not query:
            return None, "none"
        m = self.metrics
        replica = self.replica
        if replica is not None and replica.usable:
            m.child(m.match_source, "replica").inc()
            return replica.replica.match(model.domain, query), "replica"
        matcher = self.matcher
        answer = None
        if matcher is not None and matcher.available:
            answer = await matcher.match(model.domain, query, deadline)
        source = "none" if answer is None else "index"
        m.child(m.match_source, source).inc()
        return answer, source

    def _candidate(self, worker: WorkerState, model: ModelConfig, match: WorkerMatch | None,
                   predicted_blocks: int, agents: RequestTerms) -> Candidate:
        routing = self.config.routing
        load = worker.fresh_engine_load(time.monotonic(), routing.load_stale_after_s)
        blocked = None
        spec = worker.spec
        if spec.engine is not model.engine:
            blocked = "engine_mismatch"
        elif spec.block_size is not None and spec.block_size != model.block_size:
            blocked = "block_size_mismatch"
        bs = model.block_size
        ready = match.ready_blocks if match is not None else 0
        host = match.host_blocks if match is not None else 0
        disk = match.disk_blocks if match is not None else 0
        if spec.kv_eagle_drop:  # vLLM EAGLE, legacy hashes: its lookup drops the last block
            if disk:  # the last matched block is the deepest tier's
                disk -= 1
            elif host:
                host -= 1
            else:
                ready = max(ready - 1, 0)
            predicted_blocks = max(predicted_blocks - 1, 0)
        return Candidate(
            worker_id=worker.id,
            inflight=worker.inflight + worker.pending,
            engine_running=load.running if load is not None else None,
            engine_waiting=load.waiting if load is not None else None,
            high_watermark=worker.watermark(routing.high_watermark, routing.watermarks),
            prefilling=worker.prefilling,
            ledger=match.state if match is not None else LedgerState.UNSPECIFIED,
            index_tokens=ready * bs,
            host_tokens=host * bs,
            disk_tokens=disk * bs,
            predicted_tokens=predicted_blocks * bs,
            credit_blocked=blocked,
            dp_rank=match.dp_rank if match is not None and match.held_blocks else None,
            **agents.candidate(worker),
        )

    def _blocks_of(self) -> BlocksOf | None:
        """A worker's device blocks per the ledger replica (``None`` while it is not usable:
        the index's Match does not say)."""
        replica = self.replica
        if replica is None or not replica.usable:
            return None
        ledger = replica.replica

        def blocks(worker: WorkerState) -> int:  # asked only of workers with a capacity
            view = ledger.view
            return sum(view.blocks_of(Source(worker.id, rank, Tier.DEVICE))
                       for rank in range(worker.spec.dp_size))

        return blocks

    # ---- the ledger replica ----

    def on_replica_changes(self, changes: ReplicaChanges) -> None:
        """Blocks or sources the ledger lost: predictions of them go too (a prediction must
        not outlive the engine's own removal)."""
        for source, keys in changes.removed:
            removed = keys.tolist()
            self.predicted.forget_keys(source.worker_id, removed)
            if source.tier is Tier.DEVICE:
                self.agents.forget_keys(source.worker_id, removed)
        for source in changes.cleared:
            self.predicted.forget_worker(source.worker_id)
            if source.tier is Tier.DEVICE:
                self.agents.forget_worker(source.worker_id)
        self.metrics.predicted_keys.set(len(self.predicted))

    def forget_workers(self, worker_ids: list[str]) -> None:
        """Workers left the pool."""
        for worker_id in worker_ids:
            self.predicted.forget_worker(worker_id)
            self.agents.forget_worker(worker_id)

    def __repr__(self) -> str:
        return f"Router({self.predicted!r}, replica={self.replica!r})"
