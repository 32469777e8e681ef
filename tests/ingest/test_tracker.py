"""SourceTracker: seq rules, replay repair, resets, key mapping and alignment (pure)."""

from __future__ import annotations

from itertools import count

import pytest

from cortex.hashing import Engine, HashDomain, block_keys
from cortex.ingest.held import HeldBytes
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import AbortReplay, SourceTracker, StartReplay, TrackerConfig
from cortex.kvevents.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    encode_batch,
)
from cortex.ledger.model import (
    ClearBlocks,
    LedgerState,
    RemoveBlocks,
    RemoveSource,
    SetState,
    Snapshot,
    StoreBlocks,
)

BS = 4
DOMAIN = HashDomain("m", BS, Engine.VLLM)
_ts = count(1)


def payload(*events: Event, engine: Engine = Engine.VLLM, version: str = "0.33.0") -> bytes:
    batch = EventBatch(ts=float(next(_ts)), events=tuple(events), dp_rank=0)
    return encode_batch(batch, engine, version)


def stored(
    hashes: list[int], tokens: list[int], parent: int | None = None, **fields: object
) -> BlockStored:
    fields.setdefault("medium", "GPU")
    return BlockStored(tuple(hashes), parent, tuple(tokens), BS, **fields)  # type: ignore[arg-type]


def removed(*hashes: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium)


def tracker(
    replay: bool = False, block_size: int | None = BS, max_pending: int = 10_000,
    held_total: HeldBytes | None = None, **config: int,
) -> SourceTracker:
    cfg = TrackerConfig(
        engine=Engine.VLLM,
        model="m",
        block_size=block_size,
        replay=replay,
        max_pending=max_pending,
        **config,  # type: ignore[arg-type]
    )
    t = SourceTracker(SourceId("w", 0), cfg, held_total=held_total)
    t.start()
    t.on_connected()
    return t


TOKENS = list(range(1, 13))  # three blocks of 4
KEYS = DOMAIN.keys(TOKENS)


def test_live_without_replay_is_ready_and_maps_keys() -> None:
    t = tracker()
    assert t.take_ops() == [Snapshot([], [], LedgerState.READY, "live (no replay endpoint)")]
    assert t.take_commands() == []
    t.on_message(7, payload(stored([11, 12], TOKENS[:8])))
    t.on_message(8, payload(stored([13], TOKENS[8:], parent=12)))
    # a chain that goes on is one StoreBlocks: one update for the index instead of two
    assert t.take_ops() == [StoreBlocks(DOMAIN.root_key(), KEYS)]
    t.on_message(9, payload(removed(13), removed(12)))
    assert t.take_ops() == [RemoveBlocks([KEYS[2], KEYS[1]])]  # coalesced as well
    t.on_message(10, payload(stored([12, 13], TOKENS[4:], parent=11)))
    t.take_ops()
    t.on_message(11, payload(removed(13, 99), AllBlocksCleared()))
    assert t.take_ops() == [RemoveBlocks([KEYS[2]]), ClearBlocks("all_blocks_cleared")]
    assert t.stats.unknown_removed_blocks == 1
    assert t.stats.events == {"BlockStored": 3, "BlockRemoved": 3, "AllBlocksCleared": 1}
    assert t.stats.blocks == {"stored": 5, "removed": 4}
    assert t.stats.clears == {"all_blocks_cleared": 1}
    assert len(t.ledger) == 0


def test_unknown_parent_is_counted_not_guessed() -> None:
    t = tracker()
    t.take_ops()
    t.on_message(0, payload(stored([13], TOKENS[8:], parent=12)))
    assert t.take_ops() == []
    assert t.stats.unknown_parent_blocks == 1


def test_duplicate_is_dropped_and_lower_seq_with_new_payload_is_a_restart() -> None:
    t = tracker()
    t.take_ops()
    first = payload(stored([11], TOKENS[:4]))
    t.on_message(0, first)
    t.on_message(1, payload(stored([12], TOKENS[4:8], parent=11)))
    t.on_message(1, payload(stored([12], TOKENS[4:8], parent=11)))  # same seq, new ts: restart
    ops = t.take_ops()
    assert ops[1] == Snapshot([], [], LedgerState.READY, "seq_reset")
    assert t.stats.seq_resets == 1
    t.on_message(0, first)  # expected is 0 after the reset: applied
    assert t.stats.duplicates == 0
    t.on_message(0, first)  # now a duplicate
    assert t.stats.duplicates == 1
    assert t.expected == 1


def test_restart_from_zero_resets() -> None:
    t = tracker()
    for seq in range(3):
        t.on_message(seq, payload(stored([100 + seq], TOKENS[:4])))
    t.take_ops()
    t.on_message(0, payload(AllBlocksCleared()))
    ops = t.take_ops()
    assert ops == [Snapshot([], [], LedgerState.READY, "seq_reset")]  # empty ledger: no Clear op
    assert t.stats.clears == {"seq_reset": 1, "all_blocks_cleared": 1}


def test_gap_without_replay_resets_and_continues() -> None:
    t = tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    t.take_ops()
    t.on_message(5, payload(stored([21], TOKENS[4:8])))
    assert t.take_ops() == [
        Snapshot([], [], LedgerState.READY, "gap_unrepaired"),
        StoreBlocks(DOMAIN.root_key(), DOMAIN.keys(TOKENS[4:8])),
    ]
    assert t.stats.gaps == 1 and t.expected == 6


def state(t: SourceTracker) -> LedgerState:
    """The tracker's state (a call, so mypy does not carry narrowing across inputs)."""
    return t.state


def replayed_tracker() -> SourceTracker:
    """A replay-capable tracker whose initial replay found an empty buffer."""
    t = tracker(replay=True)
    assert t.take_commands() == [StartReplay(0)]
    t.on_replay_end()
    assert state(t) is LedgerState.READY
    t.take_ops()
    return t


def test_replay_waits_for_the_first_connection() -> None:
    cfg = TrackerConfig(engine=Engine.VLLM, model="m", block_size=BS, replay=True)
    t = SourceTracker(SourceId("w", 0), cfg)
    t.start()
    assert t.take_commands() == [] and state(t) is LedgerState.SYNCING
    t.on_connected()
    assert t.take_commands() == [StartReplay(0)]
    t.on_replay_timeout()  # the engine has no replay ROUTER after all: live only
    assert state(t) is LedgerState.READY
    t.on_connected()  # a later connection: a reconnect, verified through replay
    assert t.take_commands() == [AbortReplay(), StartReplay(0)]


def test_initial_replay_recovers_the_buffer_then_goes_ready() -> None:
    t = tracker(replay=True)
    assert t.take_commands() == [StartReplay(0)]
    assert state(t) is LedgerState.SYNCING
    t.on_message(42, payload(stored([13], TOKENS[8:], parent=12)))  # live, held
    t.on_replay_item(40, payload(stored([11, 12], TOKENS[:8])))  # buffer starts at 40: ok
    t.on_replay_item(41, payload(removed(11)))
    t.on_replay_end()
    ops = t.take_ops()
    assert ops == [
        Snapshot([], [], LedgerState.SYNCING, "waiting for the event stream"),
        StoreBlocks(DOMAIN.root_key(), KEYS[:2]),
        RemoveBlocks([KEYS[0]]),
        SetState(LedgerState.READY, "in sync"),
        StoreBlocks(KEYS[1], KEYS[2:]),
    ]
    assert t.stats.replays == {("initial", "ok"): 1}
    assert t.stats.clears == {}


def test_gap_repaired_by_replay() -> None:
    t = replayed_tracker()
    batches = [
        payload(stored([11], TOKENS[:4])),
        payload(stored([12], TOKENS[4:8], parent=11)),
        payload(stored([13], TOKENS[8:], parent=12)),
        payload(stored([14], TOKENS[:4])),
        payload(removed(11)),
    ]
    t.on_message(0, batches[0])
    t.on_message(3, batches[3])  # 1, 2 missing
    assert state(t) is LedgerState.STALE
    assert t.take_commands() == [StartReplay(1)]
    t.on_message(4, batches[4])  # held while replaying
    assert t.pending == 2
    for seq in (1, 2, 3):  # the replay also resends 3, which is held: applied once
        t.on_replay_item(seq, batches[seq])
    t.on_replay_end()
    assert state(t) is LedgerState.READY
    assert t.stats.replays == {("initial", "ok"): 1, ("gap", "ok"): 1}
    assert t.stats.gaps == 1 and t.stats.duplicates == 1
    assert t.expected == 5 and t.pending == 0
    assert t.take_ops() == [
        StoreBlocks(DOMAIN.root_key(), KEYS[:1]),
        SetState(LedgerState.STALE, "gap: seq 1..2 missing"),
        StoreBlocks(KEYS[0], KEYS[1:]),  # replayed batches 1 and 2: one chain
        StoreBlocks(DOMAIN.root_key(), KEYS[:1]),  # hash 14 holds the same tokens as 11 ...
        SetState(LedgerState.READY, "in sync"),
    ]  # ... so removing 11 leaves the key held: no Remove
    assert KEYS[0] in t.ledger


def test_gap_replay_that_lost_batches_resets_and_continues() -> None:
    t = replayed_tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    t.on_message(5, payload(stored([21], TOKENS[4:8])))
    assert t.take_commands() == [StartReplay(1)]
    t.on_replay_item(3, payload(stored([31], TOKENS[8:])))  # 1, 2 gone from the buffer
    t.on_replay_item(4, payload(removed(31)))
    t.on_replay_end()
    ops = t.take_ops()
    assert Snapshot([], [], LedgerState.READY, "gap_unrepaired") in ops
    assert ops[-2:] == [
        SetState(LedgerState.READY, "resynced"),
        StoreBlocks(DOMAIN.root_key(), DOMAIN.keys(TOKENS[4:8])),
    ]
    assert t.stats.replays[("gap", "incomplete")] == 1
    assert t.ledger.key_of(11) is None and t.ledger.key_of(21) is not None


def test_replay_timeout_resets_and_drains() -> None:
    t = replayed_tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    t.on_message(2, payload(stored([13], TOKENS[4:8])))
    t.take_commands()
    t.on_replay_timeout()
    assert t.take_commands() == [AbortReplay()]
    assert state(t) is LedgerState.READY and t.expected == 3
    assert t.stats.clears == {"gap_unrepaired": 1}
    assert t.stats.replays[("gap", "incomplete")] == 1


def test_replay_showing_other_batches_under_applied_seqs_is_a_restart() -> None:
    t = replayed_tracker()
    for seq in range(3):
        t.on_message(seq, payload(stored([100 + seq], TOKENS[:4])))
    t.on_message(5, payload(stored([105], TOKENS[:4])))
    assert t.take_commands() == [StartReplay(3)]
    t.on_replay_item(2, payload(AllBlocksCleared()))  # a different batch 2: new publisher
    assert t.take_commands() == [AbortReplay(), StartReplay(0)]
    assert t.stats.seq_resets == 1
    t.on_replay_item(0, payload(stored([1], TOKENS[:4])))
    t.on_replay_end()
    assert state(t) is LedgerState.READY and t.expected == 1
    assert t.ledger.key_of(1) is not None and t.ledger.key_of(100) is None


def test_live_restart_during_a_replay() -> None:
    t = replayed_tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    t.on_message(3, payload(stored([14], TOKENS[:4])))
    t.take_commands()
    t.on_message(0, payload(AllBlocksCleared()))  # the engine came back
    assert t.take_commands() == [AbortReplay()]
    assert not t.replaying and t.expected == 1 and len(t.ledger) == 0


def test_hold_buffer_overflow_gives_up_the_replay() -> None:
    t = replayed_tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    for seq in range(2, 6):
        t.on_message(seq, payload(stored([20 + seq], TOKENS[:4])))
    assert t.replaying  # max_pending not reached yet (default 10,000)
    small = tracker(replay=True, max_pending=2)
    small.on_replay_end()
    small.on_message(0, payload(stored([11], TOKENS[:4])))
    for seq in range(2, 6):
        small.on_message(seq, payload(stored([20 + seq], TOKENS[:4])))
    assert not small.replaying and small.expected == 6
    assert small.stats.clears == {"replay_overflow": 1}
    assert small.stats.replays[("gap", "incomplete")] == 1


def test_reconnect_verifies_through_replay() -> None:
    t = replayed_tracker()
    batches = [payload(stored([100 + seq], TOKENS[:4])) for seq in range(3)]
    for seq, data in enumerate(batches):
        t.on_message(seq, data)
    t.on_reconnected()
    assert state(t) is LedgerState.STALE
    assert t.take_commands() == [StartReplay(0)]
    for seq, data in enumerate(batches):
        t.on_replay_item(seq, data)  # same digests: the same publisher
    t.on_replay_item(3, payload(removed(100)))  # missed during the break
    t.on_replay_end()
    assert state(t) is LedgerState.READY and t.expected == 4
    assert t.stats.seq_resets == 0 and t.stats.replays[("reconnect", "ok")] == 1


def test_learned_block_size_announces_then_mismatch_is_misaligned() -> None:
    t = tracker(block_size=None)
    assert t.take_ops() == []  # no domain yet: the index does not hear of the source
    assert t.snapshot() is None
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    ops = t.take_ops()
    assert ops[0] == Snapshot([], [], LedgerState.READY, "live (no replay endpoint)")
    assert t.domain == DOMAIN
    t.on_message(1, payload(BlockStored((12,), None, tuple(range(8)), 8, medium="GPU")))
    assert state(t) is LedgerState.MISALIGNED
    assert t.take_ops() == [
        Snapshot([], [], LedgerState.MISALIGNED, "block size: events say 8, first events says 4")
    ]
    t.on_message(2, payload(stored([13], TOKENS[:4])))
    assert t.take_ops() == []
    assert t.stats.ignored_blocks == {"misaligned": 2}
    snap = t.snapshot()
    assert snap is not None and snap.state is LedgerState.MISALIGNED and snap.keys == []


def test_registry_block_size_disagreeing_with_events_is_misaligned() -> None:
    t = tracker(block_size=16)
    t.take_ops()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    assert state(t) is LedgerState.MISALIGNED
    assert "registry says 16" in t.reason
    assert t.stats.alignment_mismatches == {"block_size": 1}


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (stored([11], TOKENS[:4], medium="TAPE"), "medium"),
        (BlockStored((11,), None, (), 0, medium="GPU"), "placeholder"),
        (stored([11], TOKENS[:4], extra_keys=(("mm-hash", 0),)), "extra_keys"),
        (stored([11], TOKENS[:4], lora_id=3), "lora_without_name"),
        (stored([11, 12], TOKENS[:4]), "token_count"),
    ],
)
def test_unplaceable_stores_are_counted(event: BlockStored, reason: str) -> None:
    t = tracker()
    t.take_ops()
    t.on_message(0, payload(event))
    assert t.take_ops() == []
    assert reason in t.stats.ignored_blocks


def test_removal_from_another_tier_keeps_the_device_block() -> None:
    t = tracker()
    t.on_message(0, payload(stored([11], TOKENS[:4]), removed(11, medium="CPU")))
    assert t.ledger.key_of(11) is not None
    assert t.stats.unknown_removed_blocks == 1  # the host tier never held it


def test_lora_and_cache_salt_root_the_chain() -> None:
    t = tracker()
    t.take_ops()
    t.on_message(
        0,
        payload(
            stored([11], TOKENS[:4], lora_name="ad", lora_id=1, extra_keys=(("ad", "salt-1"),))
        ),
    )
    assert t.take_ops() == [
        StoreBlocks(DOMAIN.root_key("ad", "salt-1"), DOMAIN.keys(TOKENS[:4], "ad", "salt-1"))
    ]
    sg = SourceTracker(SourceId("s", 0), TrackerConfig(Engine.SGLANG, "m", BS))
    sg.start()
    sg.take_ops()
    sg.on_message(
        0, payload(stored([5], TOKENS[:4], cache_salt="s1"), engine=Engine.SGLANG, version="0.5.23")
    )
    domain = HashDomain("m", BS, Engine.SGLANG)
    assert sg.take_ops() == [
        StoreBlocks(domain.root_key(None, "s1"), domain.keys(TOKENS[:4], None, "s1"))
    ]


def test_undecodable_batch_is_counted_and_resets_a_non_empty_ledger() -> None:
    t = tracker()
    t.on_message(0, b"\xc1 not msgpack")
    assert t.stats.decode_errors == 1 and t.stats.clears == {}
    t.on_message(1, payload(stored([11], TOKENS[:4])))
    t.take_ops()
    t.on_message(2, b"\x93\x01")
    assert t.take_ops() == [Snapshot([], [], LedgerState.READY, "undecodable_batch")]
    t.on_message(3, payload(stored([12], TOKENS[:4])))
    assert t.expected == 4 and len(t.ledger) == 1


def test_remove_drops_the_source() -> None:
    t = tracker()
    t.take_ops()
    t.on_message(0, payload(stored([11], TOKENS[:4])))
    t.remove("lease expired")
    assert t.take_ops()[-2:] == [
        SetState(LedgerState.REMOVED, "lease expired"),
        RemoveSource("lease expired"),
    ]
    assert t.snapshot() is None
    t.on_message(1, payload(stored([12], TOKENS[:4])))
    assert t.take_ops() == []


def test_snapshot_lists_the_ledger() -> None:
    t = tracker()
    t.on_message(0, payload(stored([11, 12, 13], TOKENS)))
    snap = t.snapshot()
    assert snap is not None
    assert snap.keys == KEYS and snap.parent_keys == [DOMAIN.root_key(), *KEYS[:2]]
    assert snap.state is LedgerState.READY and snap.domain == DOMAIN


GOLD_VLLM = (1403909460543360175, 1643945449041937783)
GOLD_SGLANG = (8635429971592222890, 1256577331724852459, 5689809685380680247)


def test_alignment_vectors_match_and_a_wrong_seed_is_reported() -> None:
    cfg = TrackerConfig(Engine.VLLM, "m", 16, align_every=1)
    good = SourceTracker(SourceId("v", 0), cfg)
    good.start()
    event = BlockStored(GOLD_VLLM, None, tuple(range(1, 33)), 16, medium="GPU")
    good.on_message(0, payload(event))
    assert good.stats.alignment_checks == 1 and good.stats.alignment_mismatches == {}
    seeded = SourceTracker(
        SourceId("v", 1), TrackerConfig(Engine.VLLM, "m", 16, align_every=1, hash_seed="0")
    )
    seeded.start()
    seeded.on_message(0, payload(event))
    assert seeded.stats.alignment_mismatches == {"seed": 1}
    assert len(seeded.ledger) == 2  # a hash mismatch does not stop exact routing
    sg = SourceTracker(SourceId("s", 0), TrackerConfig(Engine.SGLANG, "m", 16, align_every=1))
    sg.start()
    sg.on_message(
        0,
        payload(
            BlockStored(GOLD_SGLANG, None, tuple(range(1, 49)), 16, medium="GPU"),
            engine=Engine.SGLANG,
            version="0.5.23",
        ),
    )
    assert sg.stats.alignment_checks == 1 and sg.stats.alignment_mismatches == {}
    assert block_keys(list(range(1, 49)), 16, sg.domain.root_key())  # type: ignore[union-attr]


# ---- held batches: bytes, turns, shedding --------------------------------------------------


def chain_payloads(count: int) -> list[bytes]:
    """``count`` batches of equal size, each storing one chain-start block of its own."""
    return [payload(stored([1000 + i], [i * 4 + j for j in range(4)])) for i in range(count)]


def test_held_batches_are_bounded_by_bytes_and_the_replay_gives_up() -> None:
    data = chain_payloads(8)
    size = len(data[1])
    total = HeldBytes()
    t = tracker(replay=True, held_total=total, max_pending_bytes=3 * size, align_every=0)
    t.take_commands()
    t.on_replay_end()
    t.on_message(0, data[0])
    t.take_ops()
    t.on_message(2, data[2])  # a gap: held while the replay runs
    assert t.take_commands() == [StartReplay(1)]
    t.on_message(3, data[3])
    t.on_message(4, data[4])
    assert t.replaying and t.held_bytes == 3 * size == total.total
    t.on_message(5, data[5])  # a fourth batch does not fit
    assert t.take_commands() == [AbortReplay()]
    assert not t.replaying and t.pending == 0 and t.held_bytes == 0 == total.total
    assert t.stats.dropped_batches == {"replay_overflow": 4}
    assert t.stats.clears == {"replay_overflow": 1}
    assert t.stats.replays[("gap", "incomplete")] == 1
    ops = t.take_ops()
    assert Snapshot([], [], LedgerState.READY, "replay_overflow") in ops
    assert len(t.ledger) == 0  # batch 0's block went with the reset: only under-estimates
    t.on_message(6, data[6])  # continues from the next message
    assert t.expected == 7 and t.ledger.key_of(1006) is not None
    assert state(t) is LedgerState.READY


def test_a_first_replay_given_up_still_ends_syncing() -> None:
    data = chain_payloads(3)
    t = tracker(replay=True, max_pending=1)
    assert t.take_commands() == [StartReplay(0)]
    t.on_message(0, data[0])
    t.on_message(1, data[1])  # two held: over max_pending
    assert state(t) is LedgerState.READY and not t.replaying
    assert t.stats.clears == {}  # nothing was applied yet: nothing to reset
    t.on_message(2, data[2])
    assert t.ledger.key_of(1002) is not None


def test_deferred_batches_are_applied_in_order_by_drain_in_turns() -> None:
    data = chain_payloads(6)
    size = len(data[0])
    t = tracker()
    t.take_ops()
    t.on_message(0, data[0])
    for seq in range(1, 5):
        t.on_message(seq, data[seq], defer=True)
    t.on_message(5, data[5])  # not deferred, but batches are held: it waits behind them
    assert t.pending == 5 and t.backlog and t.expected == 1
    assert t.drain(2 * size) == 2 * size  # a turn: two batches
    assert t.expected == 3 and t.pending == 3
    assert t.drain(1) == size  # at least one batch per turn
    assert t.drain() == 2 * size and not t.backlog and t.expected == 6
    assert [len(op.keys) for op in t.take_ops() if isinstance(op, StoreBlocks)] == [1] * 6


def test_a_deferred_gap_still_replays_and_keeps_the_rest_held() -> None:
    data = chain_payloads(5)
    t = replayed_tracker()
    t.on_message(0, data[0])
    t.on_message(2, data[2], defer=True)
    t.on_message(3, data[3], defer=True)
    assert t.take_commands() == []  # nothing is looked at before its turn
    t.drain()
    assert t.take_commands() == [StartReplay(1)] and t.pending == 2 and not t.backlog
    t.on_replay_item(1, data[1])
    t.on_replay_end()
    assert t.expected == 4 and t.pending == 0 and t.stats.clears == {}


def test_drain_budget_when_a_replay_ends() -> None:
    data = chain_payloads(6)
    size = len(data[0])
    t = tracker(replay=True, drain_bytes=size)
    t.take_commands()
    t.on_replay_end()
    t.on_message(0, data[0])
    for seq in range(2, 6):
        t.on_message(seq, data[seq])
    t.on_replay_item(1, data[1])
    t.on_replay_end()
    assert t.expected == 3 and t.pending == 3 and t.backlog  # one held batch per turn
    t.drain()
    assert t.expected == 6


def test_restart_found_while_draining_keeps_the_new_publishers_batches() -> None:
    data = chain_payloads(4)
    t = tracker()
    t.take_ops()
    t.on_message(0, data[0])
    t.on_message(1, data[1])
    t.on_message(0, data[2], defer=True)  # the engine restarted: a new seq 0 ...
    t.on_message(1, data[3], defer=True)  # ... and its seq 1, held behind it
    t.drain()
    assert t.stats.seq_resets == 1 and t.expected == 2
    assert t.ledger.key_of(1002) is not None and t.ledger.key_of(1003) is not None
    assert t.ledger.key_of(1000) is None


def test_shed_gives_up_everything_held_and_frees_the_shared_total() -> None:
    data = chain_payloads(4)
    total = HeldBytes(limit=len(data[0]))
    t = tracker(held_total=total)
    t.on_message(0, data[0])
    t.on_message(1, data[1], defer=True)
    t.on_message(2, data[2], defer=True)
    assert total.over
    assert t.shed("held_bytes_limit") == 2
    assert total.total == 0 and not total.over and t.expected is None
    assert t.stats.dropped_batches == {"held_bytes_limit": 2}
    assert t.stats.clears == {"held_bytes_limit": 1}
    assert t.shed("held_bytes_limit") == 0  # nothing held: nothing changes
    t.on_message(3, data[3])
    assert t.expected == 4


def test_removal_releases_held_bytes() -> None:
    data = chain_payloads(2)
    total = HeldBytes()
    t = tracker(held_total=total)
    t.on_message(0, data[0], defer=True)
    t.remove("lease expired")
    assert total.total == 0 and t.held_bytes == 0


def test_stores_past_the_capacity_bound_are_refused_counted_and_never_credited() -> None:
    t = tracker()
    t.bound(2)
    t.take_ops()
    t.on_message(0, payload(stored([11, 12], TOKENS[:8])))
    t.on_message(1, payload(stored([13], TOKENS[8:], parent=12)))  # a third block: refused
    assert t.take_ops() == [StoreBlocks(DOMAIN.root_key(), KEYS[:2])]
    assert t.misbehaving and t.stats.ignored_blocks == {"over_capacity": 1}
    assert len(t.ledger) == 2
    t.on_message(2, payload(removed(12), stored([13], TOKENS[8:], parent=11)))  # room again
    assert len(t.ledger) == 2 and t.stats.ignored_blocks == {"over_capacity": 1}
