"""Ingest's UpdateBatch parts concatenate into one batch that the index decodes into the
updates they were made from."""

from __future__ import annotations

from array import array

from cortex.hashing import Engine, HashDomain, pack_keys
from cortex.ingest.ops import SourceId
from cortex.ingest.wire import UpdateEncoder, encode_batch_bytes
from cortex.ledger.codec import pb, update_from_pb
from cortex.ledger.model import ClearBlocks, LedgerState, RemoveSource, Snapshot, StoreBlocks

DOMAIN = HashDomain("llama-3", 16, Engine.SGLANG)
BIG = 2**64 - 1


def test_every_op_round_trips_through_the_generated_classes() -> None:
    enc = UpdateEncoder(SourceId("worker-ü", 3), DOMAIN)
    updates = [
        enc.snapshot(2**40, 0, [BIG, 1], [5, BIG], LedgerState.READY, "snap"),
        enc.store(2**40, 1, BIG, [1, 2, 300]),
        enc.remove(2**40, 2, [2]),
        enc.clear(2**40, 3, "all_blocks_cleared"),
        enc.state(2**40, 4, LedgerState.STALE, "gap"),
        enc.remove_source(2**40, 5, "lease expired"),
        enc.snapshot(7, 0, [], [], LedgerState.SYNCING, ""),
    ]
    batch = pb.UpdateBatch.FromString(encode_batch_bytes("ingest-0", updates))
    assert batch.ingest_id == "ingest-0"
    assert len(batch.updates) == len(updates)
    first = batch.updates[0]
    assert first.source == pb.Source(worker_id="worker-ü", dp_rank=3)
    assert (first.domain.model, first.domain.block_size) == ("llama-3", 16)
    assert first.domain.engine == pb.ENGINE_KIND_SGLANG
    assert (first.epoch, first.seq) == (2**40, 0)
    assert [u.WhichOneof("op") for u in batch.updates] == [
        "snapshot", "store", "remove", "clear", "state", "remove_source", "snapshot",
    ]
    u = batch.updates
    assert u[0].snapshot.parent_keys_le == pack_keys([BIG, 1])
    assert u[0].snapshot.keys_le == pack_keys([5, BIG])
    assert (u[0].snapshot.state, u[0].snapshot.reason) == (pb.LEDGER_STATE_READY, "snap")
    assert u[1].store.parent_key == BIG and u[1].store.keys_le == pack_keys([1, 2, 300])
    assert u[2].remove.keys_le == pack_keys([2])
    assert u[3].clear.reason == "all_blocks_cleared"
    assert (u[4].state.state, u[4].state.reason) == (pb.LEDGER_STATE_STALE, "gap")
    assert u[5].remove_source.reason == "lease expired"
    assert u[6].snapshot.state == pb.LEDGER_STATE_SYNCING and not u[6].snapshot.keys_le
    assert batch.updates[6].epoch == 7
    decoded = [update_from_pb(u) for u in batch.updates]
    # packed keys decode into array('Q') (one copy, no int per key), which the tree reads
    assert decoded[0].op == Snapshot(array("Q", [BIG, 1]), array("Q", [5, BIG]),
                                     LedgerState.READY, "snap")
    assert decoded[1].op == StoreBlocks(BIG, array("Q", [1, 2, 300]))
    assert decoded[3].op == ClearBlocks("all_blocks_cleared")
    assert decoded[5].op == RemoveSource("lease expired")
    assert decoded[6].op == Snapshot([], [], LedgerState.SYNCING, "")
    assert {(d.source, d.domain) for d in decoded} == {(SourceId("worker-ü", 3), DOMAIN)}


def test_rank_zero_and_vllm_domain() -> None:
    enc = UpdateEncoder(SourceId("w", 0), HashDomain("m", 1, Engine.VLLM))
    (update,) = pb.UpdateBatch.FromString(enc.clear(1, 0, "")).updates
    assert update.source.dp_rank == 0 and update.domain.engine == pb.ENGINE_KIND_VLLM
    assert update.WhichOneof("op") == "clear"


def test_framed_store_and_remove_are_the_protobuf_bytes() -> None:
    """``store`` / ``remove`` frame their bytes by hand: byte for byte what the messages
    serialize to, for every width of epoch, seq, parent and key count (zeros omitted)."""
    import random

    rng = random.Random(5)
    widths = [0, 1, 127, 128, 16_383, 16_384, 2**21 - 1, 2**21, 2**32, 2**63, BIG]
    for source in (SourceId("w", 0), SourceId("worker-ü" * 40, 2**31)):
        enc = UpdateEncoder(source, DOMAIN)
        for _ in range(3_000):
            epoch = rng.choice([*widths, rng.randrange(2**64)])
            seq = rng.choice([*widths, rng.randrange(2**64)])
            parent = rng.choice([0, 1, BIG, rng.randrange(2**64)])
            keys = [rng.randrange(2**64) for _ in range(rng.choice([0, 1, 2, 15, 16, 17, 2_100]))]
            assert enc.store(epoch, seq, parent, keys) == enc.store_pb(epoch, seq, parent, keys)
            assert enc.remove(epoch, seq, keys) == enc.remove_pb(epoch, seq, keys)
