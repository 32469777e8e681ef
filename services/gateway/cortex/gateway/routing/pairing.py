"""Prefill/decode pairing (pure): the plan routing hands to the PD dispatcher.

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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from cortex.gateway.config.gateway import PDConfig
from cortex.gateway.fleet.pool import WorkerState
from cortex.gateway.routing.scoring import Decision, Scored
from cortex.hashing import Engine
from cortex.ledger.model import LedgerState

__all__ = ["CONNECTOR_VERSION_LABEL", "ENGINE_VERSION_LABEL", "LocalPrefill", "PDMode",
           "PDOutcome", "PairDecision", "compatible_pair", "connector_mismatch"]

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
