"""``SourceTracker``: the pure state machine of one ledger source (a worker's DP rank).

It is fed the raw messages of the source's PUB and replay sockets and produces, in order,
ledger operations (:mod:`cortex.ingest.ops`) for the index and commands for its socket shell
(start or abort a replay). No sockets, no clocks of its own (``now`` is injected), no asyncio.

Sequence rules (spec kv-events.md §1, architecture §4):

- the next expected ``seq`` is applied; a ``seq`` seen recently with the same payload digest is
  a duplicate and dropped;
- a ``seq`` below the expected one with a different payload is a new publisher (the engine
  restarted): the ledger is reset (new epoch) and the new publisher is read from ``seq`` 0;
- a ``seq`` above the expected one is a gap: the source turns ``STALE``, live messages are held
  (bounded) and a replay from the first missing ``seq`` is requested. Replayed batches are
  applied in order; when the replay ends, the held messages follow. A replay that skipped
  batches (the engine's buffer no longer had them), timed out or overflowed the hold buffer
  leaves a hole: the ledger is reset and continues from the first batch after the hole. A
  hole in a ledger that holds nothing yet (first connection, right after a reset) costs
  nothing and is accepted silently.
- without a replay endpoint a gap resets the ledger at once.

A cleared or partial ledger only under-estimates what the worker holds; it never invents a
hit. Epochs: every ``Reset`` starts one; ``AllBlocksCleared`` is a ``Clear`` in the same epoch
(the stream stayed continuous).
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

import xxhash

from cortex.hashing import Engine, HashDomain, block_keys
from cortex.ingest.alignment import AUTO, AlignmentChecker
from cortex.ingest.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    EventBatch,
    decode_batch,
)
from cortex.ingest.ledger import Ledger
from cortex.ingest.ops import (
    Clear,
    Drop,
    LedgerState,
    Op,
    Remove,
    Reset,
    SetState,
    SnapshotView,
    SourceId,
    Store,
)

__all__ = [
    "AbortReplay",
    "Command",
    "ReplayKind",
    "ReplayOutcome",
    "SourceStats",
    "SourceTracker",
    "StartReplay",
    "TrackerConfig",
]

log = logging.getLogger(__name__)

_DEVICE_MEDIA: Final = frozenset({None, "GPU", "gpu", "cuda", "CUDA"})
_digest: Final = xxhash.xxh3_64_intdigest


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    """Per-source settings (validated on creation).

    ``block_size``: tokens per block from the registry, ``None`` to learn it from the first
    ``BlockStored``. ``max_pending``: live batches held while a replay runs. ``dup_window``:
    recent batches remembered to tell duplicates from restarts. ``align_every``: check one
    in N chain-start stores against the engine's own hash (0 = never).
    """

    engine: Engine
    model: str
    block_size: int | None = None
    replay: bool = False
    max_pending: int = 10_000
    dup_window: int = 256
    align_every: int = 64
    hash_algo: str = AUTO
    hash_seed: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine", Engine(self.engine))
        if not self.model:
            raise ValueError("model must be non-empty")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_pending < 1 or self.dup_window < 1 or self.align_every < 0:
            raise ValueError("max_pending and dup_window must be >= 1, align_every >= 0")


@dataclass(frozen=True, slots=True)
class StartReplay:
    """Ask the replay endpoint for every buffered batch with ``seq >= start_seq``."""

    start_seq: int


@dataclass(frozen=True, slots=True)
class AbortReplay:
    """Forget the running replay: replies still in flight must not reach the tracker."""


Command = StartReplay | AbortReplay


@dataclass(slots=True)
class SourceStats:
    """Plain counters, read by the metrics collector at scrape time (no hot-path cost)."""

    messages: int = 0  # live messages received
    replayed: int = 0  # replay messages received
    batches: int = 0  # batches applied
    duplicates: int = 0
    decode_errors: int = 0
    unknown_events: int = 0  # event tags the codec does not know
    events: dict[str, int] = field(default_factory=dict)  # by event type
    blocks: dict[str, int] = field(default_factory=dict)  # "stored" / "removed"
    gaps: int = 0
    seq_resets: int = 0
    replays: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, outcome)
    clears: dict[str, int] = field(default_factory=dict)  # by reason
    unknown_parent_blocks: int = 0
    unknown_removed_blocks: int = 0
    ignored_blocks: dict[str, int] = field(default_factory=dict)  # by reason
    alignment_checks: int = 0
    alignment_mismatches: dict[str, int] = field(default_factory=dict)  # by cause
    transitions: dict[tuple[str, str], int] = field(default_factory=dict)
    rank_mismatches: int = 0
    last_batch_ts: float | None = None
    last_lag_s: float | None = None


def _bump(counter: dict[str, int], key: str, amount: int = 1) -> None:
    counter[key] = counter.get(key, 0) + amount


class ReplayKind(StrEnum):
    """Why a replay was asked for (a metric label)."""

    INITIAL = "initial"  # first connection: recover what the engine's buffer holds
    GAP = "gap"  # a seq gap in the live stream
    RECONNECT = "reconnect"  # the PUB connection broke and came back
    RESTART = "restart"  # a new publisher: read it from seq 0


class ReplayOutcome(StrEnum):
    OK = "ok"  # every missing batch arrived
    INCOMPLETE = "incomplete"  # batches were lost for good: the ledger was reset


@dataclass(slots=True)
class _Replay:
    start: int
    until: int | None  # last seq that must arrive to close the gap; None: whatever is left
    kind: ReplayKind
    hole: bool = False  # a reset happened because the replay skipped batches


class SourceTracker:
    """One source's seq tracking, ledger and key mapping. See the module docstring."""

    def __init__(
        self,
        source: SourceId,
        config: TrackerConfig,
        *,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self._clock = clock
        self.state = LedgerState.SYNCING
        self.reason = "connecting"
        self.ledger = Ledger()
        self.stats = SourceStats()
        self.block_size: int | None = config.block_size
        self.domain: HashDomain | None = (
            HashDomain(config.model, config.block_size, config.engine)
            if config.block_size is not None
            else None
        )
        self.expected: int | None = None  # next seq needed; None: no history to continue
        self._announced = False  # the index has heard of this source (needs a domain)
        self._removed = False
        self._applied_since_reset = 0
        self._replay: _Replay | None = None
        self._pending: deque[tuple[int, bytes, int]] = deque()
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest
        self._ops: list[Op] = []
        self._commands: list[Command] = []
        self._align = (
            AlignmentChecker(config.engine, hash_algo=config.hash_algo, hash_seed=config.hash_seed)
            if config.align_every
            else None
        )
        self._chain_starts = 0
        self._mismatch_logged: set[str] = set()
        self._decode_error_logged = False

    def __repr__(self) -> str:
        return (
            f"SourceTracker({self.source}, state={self.state.name}, expected={self.expected},"
            f" blocks={len(self.ledger)}, replaying={self._replay is not None},"
            f" pending={len(self._pending)})"
        )

    # ---- outputs ----------------------------------------------------------------------

    def take_ops(self) -> list[Op]:
        """Ledger operations produced since the last call, in order."""
        ops, self._ops = self._ops, []
        return ops

    def take_commands(self) -> list[Command]:
        commands, self._commands = self._commands, []
        return commands

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def pending(self) -> int:
        """Live batches held while a replay runs."""
        return len(self._pending)

    def snapshot(self) -> SnapshotView | None:
        """The whole ledger now, or ``None`` while the index must not hear of the source (no
        domain yet, or removed)."""
        if not self._announced or self._removed or self.domain is None:
            return None
        parents, keys = self.ledger.pairs()
        return SnapshotView(self.domain, parents, keys, self.state, self.reason)

    # ---- inputs -----------------------------------------------------------------------

    def start(self) -> None:
        """The sockets are up: recover what the engine's replay buffer still holds."""
        self._announce()
        if self.config.replay:
            self.expected = 0
            self._begin_replay(0, None, ReplayKind.INITIAL)
        else:
            # Nothing to confirm: a ledger built from the live stream only under-estimates.
            self._set_state(LedgerState.READY, "live (no replay endpoint)")

    def on_message(self, seq: int, payload: bytes) -> None:
        """A live message from the PUB socket."""
        if self._removed:
            return
        self.stats.messages += 1
        digest = _digest(payload)
        if self._replay is None:
            if not self._process(seq, payload, digest):
                self._pending.append((seq, payload, digest))
            return
        # A replay runs: hold the message, unless it proves the publisher restarted.
        last = self._pending[-1][0] if self._pending else None
        if (self.expected is not None and seq < self.expected) or (
            last is not None and seq <= last
        ):
            if self._recent.get(seq) == digest or any(
                s == seq and d == digest for s, _, d in self._pending
            ):
                self.stats.duplicates += 1
                return
            self._abort_replay()
            self._publisher_restarted(seq)
            if not self._process(seq, payload, digest):
                self._pending.append((seq, payload, digest))
            return
        if len(self._pending) >= self.config.max_pending:
            self._pending.append((seq, payload, digest))
            kind = self._replay.kind
            self._abort_replay()
            log.warning(
                "replay of source=%s overflowed %d held batches; resetting the ledger",
                self.source, self.config.max_pending,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
            self._count_replay(kind, ReplayOutcome.INCOMPLETE)
            self._hole("replay_overflow")
            self.expected = None  # continue from the first held message
            self._drain()
            return
        self._pending.append((seq, payload, digest))

    def on_replay_item(self, seq: int, payload: bytes) -> None:
        """One batch from the replay endpoint."""
        replay = self._replay
        if replay is None or self._removed:
            return  # a reply of an aborted replay: the shell should have dropped the socket
        self.stats.replayed += 1
        digest = _digest(payload)
        expected = self.expected
        if expected is not None and seq < expected:
            known = self._recent.get(seq)
            if known is not None and known != digest:
                # The buffer holds other batches under seqs we applied: a new publisher.
                self._abort_replay()
                self._publisher_restarted(seq)
                self._begin_replay(0, None, ReplayKind.RESTART)
                return
            return  # already applied
        if expected is not None and seq > expected and self._hole("gap_unrepaired"):
            replay.hole = True
        self._apply(seq, payload, digest)

    def on_replay_end(self) -> None:
        """The replay endpoint sent its end marker."""
        self._finish_replay(timed_out=False)

    def on_replay_timeout(self) -> None:
        """No replay reply for too long: the endpoint is down or gone."""
        if self._replay is not None:
            self._commands.append(AbortReplay())
            self._finish_replay(timed_out=True)

    def on_reconnected(self) -> None:
        """The PUB connection came back after a break: messages may be lost and the engine
        may have restarted meanwhile. Replay from the oldest remembered batch: digests of
        batches already applied reveal a restart, newer ones fill the break."""
        if self._removed or self._replay is not None or self.expected is None:
            return
        if not self.config.replay:
            return
        start = next(iter(self._recent), self.expected)
        self._set_state(LedgerState.STALE, "publisher reconnected: verifying")
        self._begin_replay(start, self.expected - 1, ReplayKind.RECONNECT)

    def remove(self, reason: str) -> None:
        """The worker left the registry (lease lost): the index prunes the source."""
        if self._removed:
            return
        if self._replay is not None:
            self._abort_replay()
        self._set_state(LedgerState.REMOVED, reason)
        if self._announced:
            self._ops.append(Drop(reason))
        self._removed = True
        self.ledger.clear()
        self._pending.clear()

    # ---- sequence handling ------------------------------------------------------------

    def _process(self, seq: int, payload: bytes, digest: int) -> bool:
        """Apply one live message under the seq rules; ``False`` when it must wait for the
        replay just started (the caller holds it)."""
        expected = self.expected
        if expected is None or seq == expected:
            self._apply(seq, payload, digest)
            return True
        if seq > expected:
            self.stats.gaps += 1
            if self.config.replay:
                self._set_state(LedgerState.STALE, f"gap: seq {expected}..{seq - 1} missing")
                self._begin_replay(expected, seq - 1, ReplayKind.GAP)
                return False
            log.warning(
                "gap source=%s seq %d..%d missing and no replay endpoint: resetting",
                self.source, expected, seq - 1,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
            self._hole("gap_unrepaired")
            self._apply(seq, payload, digest)
            return True
        if self._recent.get(seq) == digest:
            self.stats.duplicates += 1
            return True
        self._publisher_restarted(seq)
        return self._process(seq, payload, digest)

    def _publisher_restarted(self, seq: int) -> None:
        self.stats.seq_resets += 1
        log.warning(
            "seq reset source=%s: got seq %d, expected %s: the publisher restarted",
            self.source, seq, self.expected,
            extra={"worker": self.source.worker_id, "source": str(self.source)},
        )
        self._recent.clear()
        self._pending.clear()  # the dead publisher's batches: the reset supersedes them
        self._reset("seq_reset")
        self.expected = 0  # a new publisher counts from 0

    def _begin_replay(self, start: int, until: int | None, kind: ReplayKind) -> None:
        self._replay = _Replay(start=start, until=until, kind=kind)
        self._commands.append(StartReplay(start))

    def _abort_replay(self) -> None:
        self._replay = None
        self._commands.append(AbortReplay())

    def _finish_replay(self, *, timed_out: bool) -> None:
        replay, self._replay = self._replay, None
        if replay is None or self._removed:
            return
        complete = replay.until is None or (
            self.expected is not None and self.expected > replay.until
        )
        if not complete:
            self._hole("gap_unrepaired")
            self.expected = None  # continue from the first held message
        ok = complete and not replay.hole
        self._count_replay(replay.kind, ReplayOutcome.OK if ok else ReplayOutcome.INCOMPLETE)
        if ok:
            log.info(
                "replay source=%s (%s) from seq %d complete",
                self.source, replay.kind.value, replay.start,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
        else:
            log.warning(
                "replay source=%s (%s) from seq %d %s: ledger reset, continuing live",
                self.source, replay.kind.value, replay.start,
                "timed out" if timed_out else "incomplete",
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
        if self.state is not LedgerState.MISALIGNED:
            self._set_state(LedgerState.READY, "in sync" if ok else "resynced")
        self._drain()

    def _count_replay(self, kind: ReplayKind, outcome: ReplayOutcome) -> None:
        key = (kind.value, outcome.value)
        self.stats.replays[key] = self.stats.replays.get(key, 0) + 1

    def _drain(self) -> None:
        """Apply held live messages until none is left or a new gap needs a replay."""
        pending = self._pending
        while pending and self._replay is None:
            message = pending.popleft()
            if not self._process(*message):
                pending.appendleft(message)
                return

    def _hole(self, reason: str) -> bool:
        """Batches were lost for good. A ledger holding anything from before is reset
        (``True``); one fed nothing since its last reset loses nothing."""
        if not self._applied_since_reset:
            return False
        self._reset(reason)
        return True

    # ---- ledger -----------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes, digest: int) -> None:
        self.expected = seq + 1
        recent = self._recent
        recent[seq] = digest
        if len(recent) > self.config.dup_window:
            recent.popitem(last=False)
        try:
            batch = decode_batch(payload, self.config.engine)
        except CodecError as exc:
            self.stats.decode_errors += 1
            if not self._decode_error_logged:
                self._decode_error_logged = True
                log.warning(
                    "undecodable batch source=%s seq=%d: %s (later ones only counted)",
                    self.source, seq, exc,
                    extra={"worker": self.source.worker_id, "source": str(self.source)},
                )
            # The batch may have removed blocks: only a reset keeps the ledger a subset.
            if len(self.ledger):
                self._reset("undecodable_batch")
            return
        self._applied_since_reset += 1
        self._apply_batch(batch)

    def _apply_batch(self, batch: EventBatch) -> None:
        stats = self.stats
        stats.batches += 1
        stats.last_batch_ts = batch.ts
        if self._clock is not None:
            stats.last_lag_s = self._clock() - batch.ts
        if batch.skipped_unknown:
            stats.unknown_events += batch.skipped_unknown
        if batch.dp_rank is not None and batch.dp_rank != self.source.dp_rank:
            stats.rank_mismatches += 1
        events = stats.events
        for event in batch.events:
            if type(event) is BlockStored:
                events["BlockStored"] = events.get("BlockStored", 0) + 1
                self._stored(event)
            elif type(event) is BlockRemoved:
                events["BlockRemoved"] = events.get("BlockRemoved", 0) + 1
                self._removed_blocks(event)
            elif type(event) is AllBlocksCleared:
                _bump(events, "AllBlocksCleared")
                _bump(stats.clears, "all_blocks_cleared")
                if len(self.ledger):
                    self.ledger.clear()
                    if self._announced:
                        self._ops.append(Clear("all_blocks_cleared"))

    def _ignore(self, reason: str, blocks: int) -> None:
        _bump(self.stats.ignored_blocks, reason, blocks)

    def _stored(self, event: BlockStored) -> None:
        hashes = event.block_hashes
        count = len(hashes)
        _bump(self.stats.blocks, "stored", count)
        if event.medium not in _DEVICE_MEDIA:
            return self._ignore("medium", count)
        if event.group_idx:
            return self._ignore("group", count)
        size = event.block_size
        if size <= 0 or not event.token_ids:
            return self._ignore("placeholder", count)
        if self.state is LedgerState.MISALIGNED:
            return self._ignore("misaligned", count)
        if not self._check_block_size(size):
            return self._ignore("misaligned", count)
        if len(event.token_ids) != count * size:
            return self._ignore("token_count", count)
        domain = self.domain
        assert domain is not None  # set by _check_block_size
        parent_hash = event.parent_block_hash
        if parent_hash is None:
            extras = _chain_extras(event, self.config.engine)
            if isinstance(extras, str):
                return self._ignore(extras, count)
            parent = domain.root_key(*extras)
            if self._align is not None:
                self._maybe_check_alignment(event)
        else:
            if event.extra_keys is not None and _has_foreign_extras(event):
                return self._ignore("extra_keys", count)
            found = self.ledger.key_of(parent_hash)
            if found is None:
                self.stats.unknown_parent_blocks += count
                return None
            parent = found
        keys = block_keys(event.token_ids, size, parent)
        self.ledger.store(hashes, keys, parent)
        self._ops.append(Store(parent, keys))
        return None

    def _removed_blocks(self, event: BlockRemoved) -> None:
        count = len(event.block_hashes)
        _bump(self.stats.blocks, "removed", count)
        if event.medium not in _DEVICE_MEDIA:
            return self._ignore("medium", count)
        if event.group_idx:
            return self._ignore("group", count)
        dead, unknown = self.ledger.remove(event.block_hashes)
        if unknown:
            self.stats.unknown_removed_blocks += unknown
        if dead and self._announced:
            self._ops.append(Remove(dead))
        return None

    def _check_block_size(self, size: int) -> bool:
        """Learn the block size from the first store, or confirm it; a disagreement turns
        exact routing off for this source (MISALIGNED)."""
        if self.block_size is None:
            self.block_size = size
            self.domain = HashDomain(self.config.model, size, self.config.engine)
            log.info(
                "learned block size %d for source=%s", size, self.source,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
            self._announce()
            return True
        if size == self.block_size:
            return True
        configured = "registry" if self.config.block_size is not None else "first events"
        reason = f"block size: events say {size}, {configured} says {self.block_size}"
        log.error(
            "MISALIGNED source=%s: %s; exact KV routing off for this worker",
            self.source, reason,
            extra={"worker": self.source.worker_id, "source": str(self.source)},
        )
        _bump(self.stats.alignment_mismatches, "block_size")
        self._reset("misaligned", LedgerState.MISALIGNED, reason)
        return False

    def _maybe_check_alignment(self, event: BlockStored) -> None:
        assert self._align is not None
        self._chain_starts += 1
        if (self._chain_starts - 1) % self.config.align_every:
            return
        outcome = self._align.check(event)
        if outcome is None:
            return
        self.stats.alignment_checks += 1
        if outcome.cause is None:
            return
        _bump(self.stats.alignment_mismatches, outcome.cause.value)
        if outcome.cause.value not in self._mismatch_logged:
            self._mismatch_logged.add(outcome.cause.value)
            log.warning(
                "alignment mismatch source=%s likely cause=%s: %s",
                self.source, outcome.cause.value, outcome.detail,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )

    # ---- state ------------------------------------------------------------------------

    def _announce(self) -> None:
        """Introduce the source to the index once its domain is known."""
        if self._announced or self.domain is None or self._removed:
            return
        self._announced = True
        self._ops.append(Reset(self.state, self.reason))

    def _set_state(self, state: LedgerState, reason: str) -> None:
        if state is self.state and reason == self.reason:
            return
        if state is not self.state:
            key = (self.state.name, state.name)
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
            log.info(
                "source=%s %s -> %s (%s)", self.source, self.state.name, state.name, reason,
                extra={"worker": self.source.worker_id, "source": str(self.source)},
            )
        self.state, self.reason = state, reason
        if self._announced:
            self._ops.append(SetState(state, reason))

    def _reset(self, why: str, state: LedgerState | None = None, reason: str = "") -> None:
        """Empty the ledger and start a new epoch. An empty ledger fed in order is a subset
        of the truth, so it is READY (unless still SYNCING, or MISALIGNED)."""
        if state is None:
            keep = (LedgerState.SYNCING, LedgerState.MISALIGNED)
            state = self.state if self.state in keep else LedgerState.READY
        _bump(self.stats.clears, why)
        self.ledger.clear()
        self._applied_since_reset = 0
        if state is not self.state:
            key = (self.state.name, state.name)
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
        self.state, self.reason = state, reason or why
        if self._announced:
            self._ops.append(Reset(state, self.reason))


def _chain_extras(event: BlockStored, engine: Engine) -> tuple[str | None, str | None] | str:
    """``(lora_name, cache_salt)`` a chain start is rooted at, or the reason it cannot be
    placed: keys are computed from tokens, so extra inputs the gateway cannot reproduce
    (multimodal hashes, a LoRA known only by id) must not produce keys at all."""
    lora = event.lora_name
    if event.lora_id is not None and not lora:
        return "lora_without_name"
    salt = event.cache_salt
    extras = event.extra_keys
    if extras:
        first = extras[0]
        leftover = [key for key in _keys_of(first) if key != lora]
        if engine is Engine.VLLM and salt is None and len(leftover) == 1 and isinstance(
            leftover[0], str
        ):
            salt = leftover[0]  # vLLM puts the cache salt into block 0's extra keys
            leftover = []
        if leftover or _has_foreign_extras(event, skip_first=True):
            return "extra_keys"
    return lora, salt


def _has_foreign_extras(event: BlockStored, *, skip_first: bool = False) -> bool:
    """Any block's extra keys beyond the LoRA name (multimodal ids, prompt embeds)."""
    extras = event.extra_keys or ()
    lora = event.lora_name
    for index, keys in enumerate(extras):
        if skip_first and index == 0:
            continue
        if any(key != lora for key in _keys_of(keys)):
            return True
    return False


def _keys_of(block_extras: object) -> tuple[object, ...]:
    """One block's extra keys as a tuple (the codec decodes arrays as tuples; nil is none)."""
    if block_extras is None:
        return ()
    if isinstance(block_extras, tuple):
        return block_extras
    return (block_extras,)
