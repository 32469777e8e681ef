"""ReplicaHub / Subscriber: batches that queued up while a stream was sending go out as one
message, which a replica applies exactly as it would have applied them one by one."""

from __future__ import annotations

from cortex.hashing import Engine, HashDomain
from cortex.index.prefix_index import PrefixIndex
from cortex.index.replicas import ReplicaHub, Subscriber, numbered
from cortex.ledger.codec import pb
from cortex.ledger.model import LedgerUpdate, RemoveBlocks, Snapshot, Source, StoreBlocks
from cortex.ledger.replica import LedgerReplica

DOMAIN = HashDomain("m", 16, Engine.SGLANG)
ROOT = DOMAIN.root_key()


def follower(hub: ReplicaHub, merge_bytes: int) -> tuple[Subscriber, LedgerReplica]:
    sub, snapshot = hub.subscribe(frozenset(), "r")
    sub.merge_bytes = merge_bytes
    replica = LedgerReplica(clock=lambda: 0.0)
    replica.begin()
    for seq, batch in enumerate(snapshot, 1):
        batch.seq = seq
        replica.apply(batch)
    return sub, replica


async def drain(sub: Subscriber, replica: LedgerReplica) -> int:
    """Apply what ``sub`` has queued, as a stream sends it; returns the messages."""
    messages = 0
    while (data := await sub.get(0.0)) is not None:
        messages += 1
        replica.apply(pb.ReplicaBatch.FromString(numbered(replica._expect, data)))
    return messages


async def test_queued_batches_go_out_as_one_message_applied_as_several() -> None:
    core = PrefixIndex(start_version=1, wall_clock=lambda: 5.0)
    a, b = Source("a"), Source("b")
    core.apply(LedgerUpdate(a, DOMAIN, 1, 0, Snapshot([ROOT], [1])))
    ticks = iter(range(100, 200))
    hub = ReplicaHub(core, "i", queue_bytes=1 << 20, chunk_bytes=1 << 20,
                     wall_clock=lambda: float(next(ticks)))
    merging, merged = follower(hub, 1 << 20)
    single, one_by_one = follower(hub, 0)
    updates = [LedgerUpdate(a, DOMAIN, 1, 1, StoreBlocks(1, [2, 3, 4])),
               LedgerUpdate(b, DOMAIN, 1, 0, Snapshot([ROOT, 1], [1, 5])),
               LedgerUpdate(a, DOMAIN, 1, 2, RemoveBlocks([3, 4])),
               LedgerUpdate(b, DOMAIN, 1, 1, StoreBlocks(5, [6]))]
    for update in updates:  # a flush per update, as notify() does for removals
        core.apply(update, "ingest")
        assert hub.flush()
    assert await drain(merging, merged) == 1 and merging.merged == len(updates) - 1
    assert await drain(single, one_by_one) == len(updates) and single.merged == 0
    assert merged.version == one_by_one.version == core.version
    assert merged.applied_unix_s == one_by_one.applied_unix_s == 103.0  # the 4th flush stamp
    assert merging.queued_bytes == single.queued_bytes == 0
    for keys in ([1, 2, 3, 4], [1, 5, 6]):
        want = sorted(core.match(DOMAIN.model, block_keys=keys).sources)
        assert sorted(merged.match(DOMAIN, keys).sources) == want
        assert sorted(one_by_one.match(DOMAIN, keys).sources) == want


async def test_merging_stops_at_the_byte_bound() -> None:
    sub = Subscriber(frozenset(), "r", max_bytes=1000, merge_bytes=10)
    for data in (b"a" * 4, b"b" * 4, b"c" * 4, b"d" * 20):
        sub.put(data)
    assert await sub.get(0.0) == b"a" * 4 + b"b" * 4
    assert await sub.get(0.0) == b"c" * 4
    assert await sub.get(0.0) == b"d" * 20  # larger than the bound: alone
    assert await sub.get(0.0) is None and sub.queued_bytes == 0
    sub.put(b"e" * 990)
    sub.put(b"f" * 20)  # past max_bytes: cut off, nothing more is sent
    assert sub.overflowed and await sub.get(0.0) is None
