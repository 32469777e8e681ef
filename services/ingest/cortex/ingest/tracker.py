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
  and a replay from the first missing ``seq`` is requested. Replayed batches are applied in
  order; when the replay ends, the held messages follow. A replay that skipped batches (the
  engine's buffer no longer had them) or timed out leaves a hole: the ledger is reset and
  continues from the first batch after the hole. A hole in a ledger that holds nothing yet
  (first connection, right after a reset) costs nothing and is accepted silently.
- without a replay endpoint a gap resets the ledger at once.
- held batches are bounded per source in count and payload bytes (and, through a shared
  :class:`~cortex.ingest.held.HeldBytes`, in total): a bound hit gives the held batches up
  (a running replay is abandoned), resets the ledger and continues from the next message.
  The shell may also *defer* messages (hold them without decoding, to be applied by
  :meth:`SourceTracker.drain` on the source's next turn); the same bounds apply.

A cleared or partial ledger only under-estimates what the worker holds; it never invents a
hit. Epochs: every empty ``Snapshot`` starts one; ``AllBlocksCleared`` is a ``ClearBlocks`` in
the same epoch (the stream stayed continuous).

Tiers (:mod:`cortex.ingest.media`): each offload tier is a source of its own
(``source.in_tier(tier)``, ops from :meth:`SourceTracker.take_tier_ops`), announced by an
empty ``Snapshot`` with its first block; states, resets and the removal apply to all (one
stream feeds them). ``AllBlocksCleared`` clears every tier: SGLang's ``HiRadixCache.reset``
drops the host pool too; for vLLM (``reset_prefix_cache`` clears the GPU pool) it only
under-estimates.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final

import xxhash

from cortex.hashing import HashDomain
from cortex.ingest.alignment import AlignmentChecker
from cortex.ingest.columnar import (
    REMOVED,
    STORED,
    Columnar,
    ColumnarEvent,
    decode_columnar,
    materialize_event,
)
from cortex.ingest.held import HeldBatches, HeldBytes
from cortex.ingest.hybrid import is_hybrid_store
from cortex.ingest.keymap import NOT_PLAIN, KeyMapper, Misaligned
from cortex.ingest.media import tier_of
from cortex.ingest.ops import SnapshotView, SourceId, append_remove, append_store
from cortex.ingest.replay import (
    AbortReplay,
    Command,
    Replay,
    ReplayKind,
    ReplayOutcome,
    StartReplay,
)
from cortex.ingest.stats import SourceStats, bump
from cortex.ingest.tier_ops import TierOps
from cortex.ingest.tracker_config import TrackerConfig
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    decode_batch,
)
from cortex.ledger.model import (
    ClearBlocks,
    LedgerState,
    Op,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    StoreBlocks,
    Tier,
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

_digest: Final = xxhash.xxh3_64_intdigest


class SourceTracker:
    """One source's seq tracking, ledger and key mapping. See the module docstring."""

    def __init__(
        self,
        source: SourceId,
        config: TrackerConfig,
        *,
        clock: Callable[[], float] | None = None,
        held_total: HeldBytes | None = None,
    ) -> None:
        self.source = source
        self.config = config
        self._clock = clock
        self.state = LedgerState.SYNCING
        self.reason = "connecting"
        self.stats = SourceStats()
        self.keymap = KeyMapper(
            source,
            engine=config.engine,
            model=config.model,
            block_size=config.block_size,
            stats=self.stats,
            lookahead=config.kv_lookahead,
            alignment=(
                AlignmentChecker(config.engine, hash_algo=config.hash_algo,
                                 hash_seed=config.hash_seed)
                if config.align_every
                else None
            ),
            align_every=config.align_every,
        )
        self.ledger = self.keymap.ledger
        self.expected: int | None = None  # next seq needed; None: no history to continue
        self._announced = False  # the index has heard of this source (needs a domain)
        self._removed = False
        self._applied_since_reset = 0
        self._replay: Replay | None = None
        self._pending = HeldBatches(held_total)
        self._recent: OrderedDict[int, int] = OrderedDict()  # seq -> payload digest
        self._ops: list[Op] = []
        self._tier_ops = TierOps()
        self._commands: list[Command] = []
        self._decode_error_logged = False
        self._connected_before = False
        self.max_blocks = 0  # the bound of its ledger over every tier (0: none; bound())
        self.misbehaving = False  # it stored past the bound (since the last bound())
        self.on_restart: Callable[[], None] | None = None  # called when the publisher restarts

    def __repr__(self) -> str:
        return (
            f"SourceTracker({self.source}, state={self.state.name}, expected={self.expected},"
            f" blocks={len(self.ledger)}, replaying={self._replay is not None},"
            f" pending={len(self._pending)})"
        )

    @property
    def _log_fields(self) -> dict[str, str]:
        """Structured log fields of this source."""
        return {"worker": self.source.worker_id, "source": str(self.source)}

    # ---- outputs ----------------------------------------------------------------------

    def take_ops(self) -> list[Op]:
        """Ledger operations of the device source produced since the last call, in order."""
        ops, self._ops = self._ops, []
        return ops

    def take_tier_ops(self) -> dict[Tier, list[Op]]:
        """Per announced offload tier, its operations since the last call, in order."""
        return self._tier_ops.take()

    @property
    def tiers(self) -> list[Tier]:
        """The offload tiers announced to the index."""
        return self._tier_ops.tiers

    def _emit(self, op: Op) -> None:
        """An op for the device source and every announced tier."""
        self._ops.append(op)
        self._tier_ops.emit(op)

    def take_commands(self) -> list[Command]:
        commands, self._commands = self._commands, []
        return commands

    @property
    def domain(self) -> HashDomain | None:
        """The hash domain, once the block size is known."""
        return self.keymap.domain

    @property
    def replaying(self) -> bool:
        return self._replay is not None

    @property
    def pending(self) -> int:
        """Live batches held (while a replay runs, or deferred)."""
        return len(self._pending)

    @property
    def held_bytes(self) -> int:
        """Payload bytes of the held batches."""
        return self._pending.bytes

    @property
    def backlog(self) -> bool:
        """Held batches :meth:`drain` can apply now (no replay must come first)."""
        return self._replay is None and bool(self._pending)

    @property
    def oldest_held_at(self) -> float | None:
        """Arrival time (the injected clock, s) of the batch held longest."""
        return self._pending.oldest_arrival

    def snapshot(self, tier: Tier = Tier.DEVICE) -> SnapshotView | None:
        """The whole ledger of ``tier`` now, or ``None`` while the index must not hear of
        that source (no domain yet, tier not announced, or removed)."""
        if not self._announced or self._removed or self.domain is None or (
                tier is not Tier.DEVICE and tier not in self._tier_ops):
            return None
        parents, keys = self.keymap.ledgers[tier].pairs()
        return SnapshotView(self.domain, parents, keys, self.state, self.reason)

    # ---- inputs -----------------------------------------------------------------------

    def start(self) -> None:
        """The source is set up (its SUB is connecting). Without a replay endpoint nothing
        can be confirmed, and nothing needs to be: a ledger built from the live stream only
        under-estimates, so it is READY at once. With one, it stays SYNCING until the first
        connection's replay (:meth:`on_connected`) recovered the engine's buffer."""
        if self.config.replay:
            self.expected = 0
            self._set_state(LedgerState.SYNCING, "waiting for the event stream")
        else:
            self._set_state(LedgerState.READY, "live (no replay endpoint)")
        self._announce()

    def on_connected(self) -> None:
        """The event socket connected. The first time: replay from seq 0 to recover what the
        engine's buffer still holds (batches published before the subscription took effect
        included). Later: the connection came back after a break (see
        :meth:`on_reconnected`)."""
        if self._removed:
            return
        if self._connected_before:
            self.on_reconnected()
            return
        self._connected_before = True
        if self.config.replay and self._replay is None and not self._applied_since_reset:
            self._begin_replay(self.expected or 0, None, ReplayKind.INITIAL)

    def on_message(self, seq: int, payload: bytes, *, defer: bool = False) -> None:
        """A live message from the PUB socket. ``defer``: hold it without decoding (the
        shell's turn budget is spent); :meth:`drain` applies it later, in order."""
        if self._removed:
            return
        self.stats.messages += 1
        digest = _digest(payload)
        held = self._pending
        if self._replay is None:
            if held or defer:  # behind the batches already held: keep the order
                self._hold(seq, payload, digest)
            elif not self._process(seq, payload, digest):
                self._hold(seq, payload, digest)
            return
        # A replay runs: hold the message, unless it proves the publisher restarted.
        last = held.last_seq
        if (self.expected is not None and seq < self.expected) or (
            last is not None and seq <= last
        ):
            if self._recent.get(seq) == digest or held.holds(seq, digest):
                self.stats.duplicates += 1
                return
            self._abort_replay()
            held.clear()  # the dead publisher's batches: the reset supersedes them
            self._publisher_restarted(seq)
            if defer or not self._process(seq, payload, digest):
                self._hold(seq, payload, digest)
            return
        self._hold(seq, payload, digest)

    def drain(self, max_bytes: int | None = None) -> int:
        """Apply held batches in order until none is left, a new gap needs a replay first,
        or ``max_bytes`` of payload were applied (at least one batch; ``None``: no limit).
        Returns the payload bytes applied."""
        held = self._pending
        done = 0
        while held and self._replay is None and (max_bytes is None or done < max_bytes):
            item = held.popleft()
            if not self._process(item[0], item[1], item[2]):
                held.appendleft(item)
                break
            done += len(item[1])
        return done

    def shed(self, reason: str) -> int:
        """Give every held batch up (a bound was hit): a running replay is abandoned, the
        ledger reset if it held anything, and the source continues from the next message.
        Returns how many batches were dropped."""
        held = self._pending
        if not held or self._removed:
            return 0
        dropped = held.clear()
        bump(self.stats.dropped_batches, reason, dropped)
        replay, self._replay = self._replay, None
        if replay is not None:
            self._commands.append(AbortReplay())
            self._count_replay(replay.kind, ReplayOutcome.INCOMPLETE)
        log.warning(
            "source=%s gave up %d held batches (%s); resetting the ledger",
            self.source, dropped, reason, extra=self._log_fields,
        )
        self._hole(reason)
        self.expected = None  # continue from the next message
        if self.state is not LedgerState.MISALIGNED:
            self._set_state(LedgerState.READY, "resynced")
        return dropped

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
                self._pending.clear()  # held live batches: the reset supersedes them
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
            self._emit(RemoveSource(reason))
        self._removed = True
        self.keymap.clear()
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
                extra=self._log_fields,
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
            extra=self._log_fields,
        )
        self._recent.clear()
        self._reset("seq_reset")
        self.expected = 0  # a new publisher counts from 0
        if self.on_restart is not None:
            self.on_restart()

    def _begin_replay(self, start: int, until: int | None, kind: ReplayKind) -> None:
        self._replay = Replay(start=start, until=until, kind=kind)
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
                extra=self._log_fields,
            )
        else:
            log.warning(
                "replay source=%s (%s) from seq %d %s: ledger reset, continuing live",
                self.source, replay.kind.value, replay.start,
                "timed out" if timed_out else "incomplete",
                extra=self._log_fields,
            )
        if self.state is not LedgerState.MISALIGNED:
            self._set_state(LedgerState.READY, "in sync" if ok else "resynced")
        self.drain(self.config.drain_bytes)

    def _count_replay(self, kind: ReplayKind, outcome: ReplayOutcome) -> None:
        key = (kind.value, outcome.value)
        self.stats.replays[key] = self.stats.replays.get(key, 0) + 1

    def _hold(self, seq: int, payload: bytes, digest: int) -> None:
        held = self._pending
        held.append((seq, payload, digest, self._clock() if self._clock is not None else 0.0))
        cfg = self.config
        if len(held) > cfg.max_pending or held.bytes > cfg.max_pending_bytes:
            self.shed("replay_overflow" if self._replay is not None else "backlog_overflow")

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
        if self.config.columnar_decode:
            columnar = decode_columnar(payload, self.config.engine)
            if columnar is not None:
                self._applied_since_reset += 1
                self._apply_columnar(columnar)
                return
        try:
            batch = decode_batch(payload, self.config.engine)
        except CodecError as exc:
            self.stats.decode_errors += 1
            if not self._decode_error_logged:
                self._decode_error_logged = True
                log.warning(
                    "undecodable batch source=%s seq=%d: %s (later ones only counted)",
                    self.source, seq, exc,
                    extra=self._log_fields,
                )
            # The batch may have removed blocks: only a reset keeps the ledger a subset.
            if self.keymap.blocks:
                self._reset("undecodable_batch")
            return
        self._applied_since_reset += 1
        self._apply_batch(batch)

    def _batch_stats(self, ts: float, dp_rank: int | None, skipped_unknown: int) -> None:
        stats = self.stats
        stats.batches += 1
        stats.last_batch_ts = ts
        if self._clock is not None:
            now = self._clock()
            stats.last_applied_unix_s = now
            stats.last_lag_s = now - ts
        if skipped_unknown:
            stats.unknown_events += skipped_unknown
        if dp_rank is not None and dp_rank != self.source.dp_rank:
            stats.rank_mismatches += 1

    def _apply_batch(self, batch: EventBatch) -> None:
        self._batch_stats(batch.ts, batch.dp_rank, batch.skipped_unknown)
        self._apply_events(batch.events)

    def _apply_columnar(self, batch: Columnar) -> None:
        """:meth:`_apply_batch` of a batch decoded in C (:mod:`cortex.ingest.columnar`):
        plain device stores and removals take the fast path below, every other event is
        materialized and applied as the codec's would be -- same ops, ledger and stats."""
        ts, dp_rank, events = batch
        self._batch_stats(ts, dp_rank, 0)
        for event in events:
            tag = event[0]
            if tag == STORED:
                if self._store_plain(event):
                    continue
            elif tag == REMOVED and self._remove_plain(event):
                continue
            self._apply_events(materialize_event(event))

    def _store_plain(self, event: ColumnarEvent) -> bool:
        """A columnar store placed by :meth:`KeyMapper.place_plain`; ``False`` (nothing
        changed) when it is not a plain device store of this source."""
        hashes, medium, kind, group = event[1], event[5], event[6], event[7]
        keymap = self.keymap
        bound = self.max_blocks
        if ((medium is not None and tier_of(medium) is not Tier.DEVICE)
                or is_hybrid_store(group or 0, kind)
                or (bound and keymap.blocks + len(hashes) > bound)):
            return False
        placed = keymap.place_plain(event)
        if placed is NOT_PLAIN:
            return False
        bump(self.stats.events, "BlockStored")
        if placed is not None:
            assert type(placed) is StoreBlocks
            if not self._announced:
                self._announce()
            append_store(self._ops, placed)
        return True

    def _remove_plain(self, event: ColumnarEvent) -> bool:
        """A run of columnar removals from the device ledger of a source that is not
        hybrid, applied at once; ``False`` (nothing changed) for any other."""
        _, hashes, medium, group, _, _, sizes = event
        keymap = self.keymap
        if ((medium is not None and tier_of(medium) is not Tier.DEVICE) or group
                or keymap.hybrid is not None):
            return False
        stats = self.stats
        bump(stats.events, "BlockRemoved", len(sizes) // 4)
        bump(stats.blocks, "removed", len(hashes))
        dead, unknown = keymap.ledger.remove(hashes)
        if unknown:
            stats.unknown_removed_blocks += unknown
        if dead and self._announced:
            append_remove(self._ops, dead)
        return True

    def _apply_events(self, batch_events: Iterable[Event]) -> None:
        stats = self.stats
        events = stats.events
        keymap = self.keymap
        ops = self._ops
        bound = self.max_blocks
        for event in batch_events:
            if type(event) is BlockStored:
                events["BlockStored"] = events.get("BlockStored", 0) + 1
                if bound and keymap.blocks + len(event.block_hashes) > bound:
                    self._over_capacity(len(event.block_hashes))
                    continue
                tier = tier_of(event.medium)
                placed = keymap.stored(event, tier)
                if placed is None or tier is None:
                    continue
                if type(placed) is Misaligned:
                    self._reset("misaligned", LedgerState.MISALIGNED, placed.reason)
                    ops = self._ops
                    continue
                if not self._announced:
                    self._announce()  # the block size was just learned
                target = ops if tier is Tier.DEVICE else self._tier(tier)
                # a list: an offload store's resolved runs, or a hybrid source's credit moves
                for op in placed if type(placed) is list else (placed,):
                    if type(op) is StoreBlocks:
                        append_store(target, op)
                    else:
                        assert type(op) is RemoveBlocks
                        append_remove(target, op.keys)
            elif type(event) is BlockRemoved:
                events["BlockRemoved"] = events.get("BlockRemoved", 0) + 1
                tier = tier_of(event.medium)
                dead = keymap.removed(event, tier)
                if dead and self._announced and tier is not None:
                    append_remove(ops if tier is Tier.DEVICE else self._tier(tier), dead)
            elif type(event) is AllBlocksCleared:
                bump(events, "AllBlocksCleared")
                bump(stats.clears, "all_blocks_cleared")
                self._clear_all()

    def bound(self, max_blocks: int) -> None:
        """Credit the source with at most ``max_blocks`` blocks over every tier (its
        worker's reported capacity with a margin; 0: no bound). A new bound is a new
        assessment: ``misbehaving`` clears (the refused blocks stay counted)."""
        self.max_blocks = max_blocks
        self.misbehaving = False

    def _over_capacity(self, blocks: int) -> None:
        """A store past the bound: refused (never mapped, so never credited) and counted;
        the first one marks the source misbehaving, loudly."""
        bump(self.stats.ignored_blocks, "over_capacity", blocks)
        if not self.misbehaving:
            self.misbehaving = True
            log.warning("source %s misbehaving: stores past its worker's capacity (%d blocks "
                        "with the margin) are refused", self.source, self.max_blocks,
                        extra=self._log_fields)

    def _clear_all(self) -> None:
        """``AllBlocksCleared``: every tier holding blocks is cleared (same epoch)."""
        for tier, ledger in self.keymap.ledgers.items():
            if len(ledger) and self._announced and (tier is Tier.DEVICE or tier in self._tier_ops):
                (self._ops if tier is Tier.DEVICE else self._tier(tier)).append(
                    ClearBlocks("all_blocks_cleared"))
        self.keymap.clear()  # every tier, and a hybrid source's group state

    def _tier(self, tier: Tier) -> list[Op]:
        return self._tier_ops.of(tier, self.state, self.reason)

    # ---- state ------------------------------------------------------------------------

    def _announce(self) -> None:
        """Introduce the source to the index once its domain is known."""
        if self._announced or self.domain is None or self._removed:
            return
        self._announced = True
        self._ops.append(Snapshot([], [], self.state, self.reason))

    def _set_state(self, state: LedgerState, reason: str) -> None:
        if state is self.state and reason == self.reason:
            return
        if state is not self.state:
            key = (self.state.name, state.name)
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
            log.info(
                "source=%s %s -> %s (%s)", self.source, self.state.name, state.name, reason,
                extra=self._log_fields,
            )
        self.state, self.reason = state, reason
        if self._announced:
            self._emit(SetState(state, reason))

    def _reset(self, why: str, state: LedgerState | None = None, reason: str = "") -> None:
        """Empty the ledger and start a new epoch. An empty ledger fed in order is a subset
        of the truth, so it is READY (unless still SYNCING, or MISALIGNED)."""
        if state is None:
            keep = (LedgerState.SYNCING, LedgerState.MISALIGNED)
            state = self.state if self.state in keep else LedgerState.READY
        bump(self.stats.clears, why)
        self.keymap.clear()
        self._applied_since_reset = 0
        if state is not self.state:
            key = (self.state.name, state.name)
            self.stats.transitions[key] = self.stats.transitions.get(key, 0) + 1
        self.state, self.reason = state, reason or why
        if self._announced:
            self._emit(Snapshot([], [], state, self.reason))
