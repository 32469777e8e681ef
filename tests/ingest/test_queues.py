"""SourceQueues: per-source FIFOs served in turns, with byte accounting (pure)."""

from __future__ import annotations

from cortex.ingest.ops import SourceId
from cortex.ingest.queues import SourceQueues

A, B, C = SourceId("a"), SourceId("b"), SourceId("c")


def drain(queues: SourceQueues[str]) -> list[str]:
    out = []
    while (head := queues.pop()) is not None:
        out.append(head[1])
    return out


def test_sources_take_turns_of_quantum_bytes_and_keep_their_own_order() -> None:
    queues: SourceQueues[str] = SourceQueues(quantum_bytes=20)
    for i in range(6):
        queues.push(A, f"a{i}", 10, now=0.0)  # a backlog of six
    queues.push(B, "b0", 10, now=1.0)
    queues.push(C, "c0", 50, now=2.0)  # one item larger than a turn: still goes whole
    queues.push(C, "c1", 10, now=2.0)
    assert drain(queues) == ["a0", "a1", "b0", "c0", "a2", "a3", "c1", "a4", "a5"]
    assert len(queues) == 0 and queues.bytes == 0 and not queues


def test_a_source_arriving_later_is_served_within_one_round() -> None:
    queues: SourceQueues[str] = SourceQueues(quantum_bytes=10)
    for i in range(100):
        queues.push(A, f"a{i}", 10, now=0.0)
    assert queues.pop() == (A, "a0")
    queues.push(B, "b0", 10, now=1.0)
    # B waits for one turn of each source ahead of it, not for A's backlog
    assert [queues.pop(), queues.pop(), queues.pop()] == [(A, "a1"), (B, "b0"), (A, "a2")]


def test_bounded_and_unbounded_bytes_are_counted_apart() -> None:
    queues: SourceQueues[str] = SourceQueues(quantum_bytes=1 << 20)
    queues.push(A, "op", 100, now=5.0)
    queues.push(A, "snapshot part", 4000, now=6.0, bounded=False)
    queues.extend(B, ["op1", "op2"], [100, 200], now=7.0)
    assert queues.bytes == 4400 and queues.bounded_bytes == 400 and queues.bounded_items == 3
    assert queues.bounded_bytes_of(A) == 100 and queues.bounded_bytes_of(C) == 0
    assert queues.largest() == B  # by bounded bytes: A's snapshot part does not count
    assert queues.oldest() == 5.0
    assert queues.drop(A) == 2
    assert queues.bytes == 300 and queues.bounded_bytes == 300 and queues.oldest() == 7.0
    assert drain(queues) == ["op1", "op2"] and queues.bounded_items == 0
    assert queues.drop(A) == 0
    queues.push(C, "x", 1, now=8.0)
    queues.clear()
    assert queues.largest() is None and queues.oldest() is None and queues.bytes == 0


def test_dropping_the_source_in_turn_starts_the_next_turn_afresh() -> None:
    queues: SourceQueues[str] = SourceQueues(quantum_bytes=20)
    for i in range(3):
        queues.push(A, f"a{i}", 10, now=0.0)
        queues.push(B, f"b{i}", 10, now=0.0)
    assert queues.pop() == (A, "a0")  # A used half its turn
    queues.drop(A)
    assert drain(queues) == ["b0", "b1", "b2"]
