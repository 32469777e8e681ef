"""The simulated engine: admission, prefill/decode timing, cache updates, PD legs, events.

Async only where time passes (queueing, prefill, decode, handoffs); every decision is made
by the pure parts (:mod:`cache`, :mod:`timing`, :mod:`textgen`). Cache changes made in one
event-loop iteration are published as one event batch (one "scheduler step").
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from cortex.chat import ChatTokenizer
from cortex.hashing import Engine
from cortex.sim.cache import Lease, PrefixCache, blocks_for
from cortex.sim.config import Role, SimConfig, default_bootstrap_port
from cortex.sim.hashers import EngineHasher
from cortex.sim.host import HostPool
from cortex.sim.pd import KvHandoff, KvTransferClient, KvTransferServer, TransferError
from cortex.sim.protocol import GenRequest, RequestError, SequenceResult, SequenceSpec
from cortex.sim.publisher import EventPublisher
from cortex.sim.scheduler import AdmissionQueue
from cortex.sim.textgen import FinishReason, GenerationPlan, TextGenerator
from cortex.sim.timing import TimingModel

__all__ = ["EngineHasher", "Leg", "SimEngine", "SimStats"]

log = logging.getLogger(__name__)

Emit = Callable[[SequenceResult, int], Awaitable[None]]
"""Streaming callback: the sequence so far and how many of its tokens are out."""


class Leg(StrEnum):
    """How one sequence is served."""

    REGULAR = "regular"
    SGLANG_PREFILL = "sglang_prefill"
    SGLANG_DECODE = "sglang_decode"
    VLLM_PREFILL = "vllm_prefill"
    VLLM_DECODE = "vllm_decode"


@dataclass(slots=True)
class SimStats:
    """Cumulative counters (since start)."""

    requests_started: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generation_tokens: int = 0
    kv_pulls: int = 0
    kv_pull_failures: int = 0
    first_token_streams: int = 0
    first_token_us: int = 0
    """Streamed requests, and the sum of their times (µs) from the request reaching the
    HTTP handler to their first token written (parsing, tokenizing, queueing, prefill):
    the engine's share of the time to first token (counted on rank 0)."""


@dataclass(eq=False, slots=True)
class _Decode:
    """A decode under way: its first token at ``started`` (monotonic s), then one per
    ``step_s``."""

    started: float
    tokens: int
    step_s: float

    def generated(self, now: float) -> int:
        if self.step_s <= 0:
            return self.tokens
        return min(self.tokens, 1 + int((now - self.started) / self.step_s))


class SimEngine:
    """One data-parallel rank of a simulated worker: its KV pool and prefix cache, admission,
    prefill lane and event publisher (a worker with ``dp_size`` N has N of them)."""

    def __init__(
        self,
        config: SimConfig,
        chat: ChatTokenizer,
        *,
        publisher: EventPublisher | None = None,
        transfer_server: KvTransferServer | None = None,
        transfer_client: KvTransferClient | None = None,
        transfer_port: int = 0,
        dp_rank: int = 0,
        textgen: TextGenerator | None = None,
    ) -> None:
        self.config = config
        self.chat = chat
        self.dp_rank = dp_rank
        self.cache = PrefixCache(
            config.kv_capacity_blocks,
            config.block_size,
            EngineHasher(config.engine, config.block_size, config.eagle_lookahead),
            coalesce_removals=config.engine is Engine.SGLANG,
            enabled=config.caches_prefixes,
            host=HostPool(config.host_capacity_blocks) if config.host_capacity_blocks else None,
            lookahead=config.eagle_lookahead,
            # SGLang matches the prompt minus its last token as bigrams: one token fewer.
            match_margin=2 if config.eagle_lookahead and config.engine is Engine.SGLANG else 1,
            drop_last=config.eagle_drop,
        )
        self.timing = TimingModel(config.timing)
        self.textgen = textgen or TextGenerator(chat.tokenizer, seed=config.seed,
                                                natural_tokens=config.output_tokens,
                                                eos_token_id=chat.eos_token_id)
        self.admission = AdmissionQueue(self.cache, config.max_running, self._cache_changed)
        self.stats = SimStats()
        self._publisher = publisher
        self._transfer_server = transfer_server
        self._transfer_client = transfer_client
        self._transfer_port = transfer_port
        self._prefill_lane = asyncio.Lock()
        self._decodes: set[_Decode] = set()
        self._flush_scheduled = False
        self.engine_id = config.engine_id or f"cortex-sim-{config.public_host}-{config.port}"
        self.started_at = time.time()

    # -- events ---------------------------------------------------------------------------

    def _cache_changed(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush_events)

    def _flush_events(self) -> None:
        self._flush_scheduled = False
        events = self.cache.drain_events()
        if events and self._publisher is not None:
            self._publisher.publish(events)

    def announce_start(self) -> None:
        """SGLang publishes an ``AllBlocksCleared`` right after start-up."""
        if self.config.engine is Engine.SGLANG and self.cache.enabled:
            self.cache.reset()
            self._cache_changed()

    def flush_cache(self) -> bool:
        """Drop the prefix cache if no request holds it (``AllBlocksCleared``)."""
        if self.admission.waiting:
            return False
        cleared = self.cache.clear()
        if cleared:
            self._cache_changed()
        return cleared

    def restart(self) -> None:
        """Fault: behave as a restarted engine (seq from 0, empty cache, ``AllBlocksCleared``).

        Pending events are discarded: a restarted engine never sends them.
        """
        self.cache.drain_events()
        if self._publisher is not None:
            self._publisher.restart()
        self.cache.reset()
        if not self.cache.enabled:
            return
        self._cache_changed()

    def event_state(self) -> dict[str, Any]:
        """Publisher counters (seq, batches, events, drops, replay requests)."""
        pub = self._publisher
        if pub is None:
            return {}
        return {"next_seq": pub.next_seq, "sent_batches": pub.sent_batches,
                "sent_events": pub.sent_events, "dropped_batches": pub.dropped_batches,
                "buffered_batches": pub.buffered, "replay_requests": pub.replay_requests}

    def stats_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self.stats)

    # -- load -----------------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self.admission.running

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use by running requests or the cache (0 to 1)."""
        return self.cache.used_blocks / self.cache.capacity

    # -- serving --------------------------------------------------------------------------

    def leg(self, req: GenRequest, seq: SequenceSpec) -> Leg:
        """Which PD leg (if any) this sequence is, validating the request for it."""
        cfg = self.config
        if cfg.engine is Engine.SGLANG:
            if cfg.role is Role.REGULAR:
                return Leg.REGULAR
            if seq.bootstrap_room is None or (cfg.role is Role.DECODE
                                              and not seq.bootstrap_host):
                raise RequestError(
                    f"disaggregation mode {cfg.role.value} needs bootstrap_host and "
                    "bootstrap_room in the request", param="bootstrap_room")
            return Leg.SGLANG_PREFILL if cfg.role is Role.PREFILL else Leg.SGLANG_DECODE
        params = req.kv_transfer_params or {}
        if cfg.role is Role.PREFILL and params.get("do_remote_decode"):
            if len(req.sequences) != 1:
                raise RequestError("kv_transfer_params needs a single sequence (n=1)",
                                   param="kv_transfer_params")
            return Leg.VLLM_PREFILL
        if cfg.role is Role.DECODE and params.get("do_remote_prefill"):
            if len(req.sequences) != 1:
                raise RequestError("kv_transfer_params needs a single sequence (n=1)",
                                   param="kv_transfer_params")
            return Leg.VLLM_DECODE
        return Leg.REGULAR

    def _plan(self, req: GenRequest, seq: SequenceSpec, leg: Leg) -> GenerationPlan:
        if leg in (Leg.SGLANG_PREFILL, Leg.VLLM_PREFILL):
            plan = self.textgen.plan(seq.prompt_ids, max_tokens=1, ignore_eos=True,
                                     request_seed=req.seed)
            return replace(plan, finish_reason=FinishReason.LENGTH)
        return self.textgen.plan(seq.prompt_ids, max_tokens=req.max_tokens,
                                 ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                                 request_seed=req.seed)

    def check(self, req: GenRequest) -> None:
        """Reject what the engine would reject before queueing (context length, capacity)."""
        cfg = self.config
        for seq in req.sequences:
            self.leg(req, seq)
            prompt_len = len(seq.prompt_ids)
            if prompt_len == 0:
                raise RequestError("the prompt is empty", param="prompt")
            wanted = prompt_len + (req.max_tokens or 1)
            if prompt_len >= cfg.max_model_len or (req.max_tokens and wanted > cfg.max_model_len):
                raise RequestError(
                    f"This model's maximum context length is {cfg.max_model_len} tokens. "
                    f"However, you requested {wanted} tokens ({prompt_len} in the messages, "
                    f"{req.max_tokens or 0} in the completion).", param="max_tokens")
            if blocks_for(prompt_len + 1, cfg.block_size) > cfg.kv_capacity_blocks:
                raise RequestError(
                    f"The input ({prompt_len} tokens) is longer than the KV cache "
                    f"({cfg.kv_capacity_blocks * cfg.block_size} tokens).", param="prompt")

    async def run(self, req: GenRequest, seq: SequenceSpec, emit: Emit | None = None
                  ) -> SequenceResult:
        """Serve one sequence: queue, prefill (or PD handoff), decode; returns its result.

        Raises :class:`TransferError` when an SGLang PD handoff fails (HTTP 500).
        """
        started = time.monotonic()
        leg = self.leg(req, seq)
        plan = self._plan(req, seq, leg)
        # Output never outgrows the KV pool: trim the plan to what can ever fit.
        room_tokens = self.config.kv_capacity_blocks * self.config.block_size
        if len(seq.prompt_ids) + len(plan) > room_tokens:
            keep = max(room_tokens - len(seq.prompt_ids), 1)
            plan = GenerationPlan(plan.token_ids[:keep], plan.pieces[:keep], FinishReason.LENGTH)
        self.stats.requests_started += 1
        try:
            if leg is Leg.SGLANG_PREFILL:
                result = await self._run_sglang_prefill(req, seq, plan, started, emit)
            else:
                result = await self._run_local(req, seq, plan, leg, started, emit)
        except BaseException:
            self.stats.requests_failed += 1
            raise
        self.stats.requests_finished += 1
        self.stats.cached_tokens += result.cached_tokens
        return result

    async def _run_sglang_prefill(self, req: GenRequest, seq: SequenceSpec,
                                  plan: GenerationPlan, started: float, emit: Emit | None
                                  ) -> SequenceResult:
        if self._transfer_server is None or seq.bootstrap_room is None:
            raise TransferError("this worker has no KV side channel")
        async with self._transfer_server.room(seq.bootstrap_room) as ticket:
            await ticket.wait_handshake(self.config.bootstrap_timeout_s)
            lease = await self.admission.acquire(seq.prompt_ids, len(seq.prompt_ids) + 1,
                                                 req.lora, req.media)
            try:
                await self._prefill(len(seq.prompt_ids) - lease.cached_tokens,
                                    lease.loaded_tokens)
                self.cache.commit(lease, seq.prompt_ids)
                self._cache_changed()
                self.stats.prompt_tokens += len(seq.prompt_ids)
                self.stats.generation_tokens += len(plan)  # its one token
                await ticket.send(KvHandoff(seq.prompt_ids, lease.cached_tokens))
                result = self._result(seq, lease.cached_tokens, plan, started)
                if emit is not None:
                    await emit(result, len(plan))
                return result
            finally:
                self.cache.release(lease)
                self.admission.release_slot()
                self._cache_changed()

    async def _run_local(self, req: GenRequest, seq: SequenceSpec, plan: GenerationPlan,
                         leg: Leg, started: float, emit: Emit | None) -> SequenceResult:
        prompt = seq.prompt_ids
        lease = await self.admission.acquire(prompt, len(prompt) + len(plan), req.lora,
                                             req.media)
        keep_lease = False
        try:
            cached = lease.cached_tokens
            kv_source: str | None = None
            if leg is Leg.SGLANG_DECODE:
                handoff = await self._pull_room(req, seq)
                cached = handoff.cached_tokens
            elif leg is Leg.VLLM_DECODE:
                pulled = await self._read_remote(req, prompt)
                kv_source = "remote" if pulled is not None else "local"
                if pulled is not None:
                    cached = max(cached, pulled)
                await self._prefill(len(prompt) - cached)
            else:
                await self._prefill(len(prompt) - cached, lease.loaded_tokens)
            self.cache.commit(lease, prompt)
            self._cache_changed()
            result = self._result(seq, cached, plan, started, kv_source=kv_source)
            if leg is Leg.VLLM_PREFILL:  # before the answer: a stream's final chunk has them
                result = replace(result, kv_transfer_params=self._hold(req, lease, prompt))
                keep_lease = True
            await self._decode(result, emit)
            if len(plan) > 1:
                self.cache.commit(lease, prompt + plan.token_ids[:-1])
                self._cache_changed()
            return replace(result, e2e_ms=(time.monotonic() - started) * 1000.0)
        finally:
            if not keep_lease:
                self.cache.release(lease)
            self.admission.release_slot()
            self._cache_changed()

    def _result(self, seq: SequenceSpec, cached: int, plan: GenerationPlan, started: float,
                kv_source: str | None = None) -> SequenceResult:
        return SequenceResult(index=seq.index, prompt_tokens=len(seq.prompt_ids),
                              cached_tokens=cached, plan=plan,
                              e2e_ms=(time.monotonic() - started) * 1000.0,
                              prompt_index=seq.prompt_index, kv_source=kv_source)

    async def _prefill(self, uncached_tokens: int, loaded_tokens: int = 0) -> None:
        if self.timing.zero_cost:
            return
        async with self._prefill_lane:  # one prefill at a time, FIFO
            await asyncio.sleep(self.timing.prefill_ms(uncached_tokens, loaded_tokens) / 1000.0)

    async def _decode(self, result: SequenceResult, emit: Emit | None) -> None:
        """Emit the first token now (TTFT), then one per ``decode_ms_per_token``.

        The prompt and generation token counters advance as a real engine's do, step by
        step (vLLM counts a prompt's tokens at its first token and each generated token at
        the step that made it), not when the request ends: a busy engine's counters move
        while a long answer is still being generated (the gateway's wedge watch reads them).
        """
        count = len(result.plan)
        self.stats.prompt_tokens += result.prompt_tokens
        step = self.timing.decode_ms(1) / 1000.0
        decode = _Decode(time.monotonic(), count, step)
        self._decodes.add(decode)
        try:
            if emit is None:
                if count > 1 and not self.timing.zero_cost:
                    await asyncio.sleep(self.timing.decode_ms(count - 1) / 1000.0)
                return
            for done in range(1, count + 1):
                if done > 1 and step > 0:
                    await asyncio.sleep(step)
                await emit(result, done)
        finally:
            self._decodes.discard(decode)
            self.stats.generation_tokens += decode.generated(time.monotonic())

    def generated_tokens(self, now: float) -> int:
        """Tokens generated since start (monotonic ``now``), the decodes under way included."""
        return self.stats.generation_tokens + sum(d.generated(now) for d in self._decodes)

    def undecoded_tokens(self, now: float) -> int:
        """Tokens the decodes under way reserved and have not generated yet (a real engine
        allocates them token by token)."""
        return sum(d.tokens - d.generated(now) for d in self._decodes)

    # -- PD helpers -----------------------------------------------------------------------

    async def _pull_room(self, req: GenRequest, seq: SequenceSpec) -> KvHandoff:
        if self._transfer_client is None or seq.bootstrap_room is None or not seq.bootstrap_host:
            raise TransferError("no bootstrap information")
        port = seq.bootstrap_port if seq.bootstrap_port is not None else default_bootstrap_port()
        self.stats.kv_pulls += 1
        try:
            handoff = await self._transfer_client.pull_room(
                seq.bootstrap_host, port, seq.bootstrap_room, self.config.transfer_timeout_s,
                prefill_dp_rank=req.prefill_dp_rank)
            if handoff.token_ids != seq.prompt_ids:
                raise TransferError(
                    f"bootstrap room {seq.bootstrap_room} holds KV of a different prompt")
        except TransferError:
            self.stats.kv_pull_failures += 1
            raise
        return handoff

    async def _read_remote(self, req: GenRequest, prompt: Sequence[int]) -> int | None:
        """vLLM decode: pull the prefill's blocks; tokens pulled, or ``None`` (recompute)."""
        params = req.kv_transfer_params or {}
        self.stats.kv_pulls += 1
        try:
            if self._transfer_client is None:
                raise TransferError("no KV connector")
            host, port = params.get("remote_host"), params.get("remote_port")
            request_id = params.get("remote_request_id")
            if not isinstance(host, str) or not isinstance(port, int) or not isinstance(
                    request_id, str):
                raise TransferError("kv_transfer_params lack remote_host/port/request_id")
            if ("remote_registration_generation" in params) != self._nixl_v15:
                # the connectors' compatibility hashes differ: the handshake fails
                raise TransferError("the prefill runs another NIXL connector version")
            block_ids = _flat_ids(params.get("remote_block_ids"))
            handoff = await self._transfer_client.read_blocks(
                host, port, request_id, block_ids, self.config.transfer_timeout_s)
            if tuple(prompt[: len(handoff.token_ids)]) != handoff.token_ids:
                raise TransferError("remote blocks hold KV of a different prompt")
        except TransferError as exc:
            self.stats.kv_pull_failures += 1
            log.warning("KV transfer failed, recomputing the prefill locally: %s", exc)
            return None
        return len(handoff.token_ids)

    def _hold(self, req: GenRequest, lease: Lease, prompt: Sequence[int]) -> dict[str, Any]:
        """vLLM prefill: keep the prompt blocks for the decode; the params that find them."""
        full = len(prompt) // self.config.block_size
        block_ids = lease.block_ids[:full]
        handoff = KvHandoff(tuple(prompt[: full * self.config.block_size]), lease.cached_tokens,
                            tuple(block_ids))
        if self._transfer_server is None:
            self.cache.release(lease)
            raise TransferError("this worker has no KV side channel")

        def release() -> None:
            self.cache.release(lease)
            self.admission.pump()
            self._cache_changed()

        self._transfer_server.hold(req.request_id, handoff, release,
                                   self.config.kv_hold_timeout_s)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(block_ids)],
            "remote_engine_id": self.engine_id,
            "remote_request_id": req.request_id,
            "remote_host": self.config.public_host,
            "remote_port": self._transfer_port,
            "tp_size": 1,
            **({"remote_registration_generation": 0} if self._nixl_v15 else {}),
        }

    @property
    def _nixl_v15(self) -> bool:
        """vLLM >= 0.33: ``NIXL_CONNECTOR_VERSION`` 15, which adds
        ``remote_registration_generation`` to ``kv_transfer_params``."""
        return self.config.engine is Engine.VLLM and self.config.version_tuple >= (0, 33)

    def __repr__(self) -> str:
        return (f"SimEngine({self.config.engine.value} {self.config.engine_version} "
                f"{self.config.role.value}, dp_rank={self.dp_rank}, {self.admission!r}, "
                f"{self.cache!r})")


def _flat_ids(value: object) -> list[int]:
    """``remote_block_ids`` as a flat list (newer engines nest one list per KV group)."""
    if not isinstance(value, list):
        return []
    out: list[int] = []
    for item in value:
        if isinstance(item, list):
            out.extend(int(x) for x in item)
        elif isinstance(item, int):
            out.append(item)
    return out
