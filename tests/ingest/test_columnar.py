"""The compiled KV-event decoder (``cortex.ingest.columnar``) against ``decode_batch``, the
specification, and the tracker's fast path against its path through ``decode_batch``.

Decoder: on golden payloads of every released engine version, on payloads of the simulator's
engines, on mutations and truncations of both and on generated batches whose fields are the
common shapes with some replaced by near misses, the compiled decoder either declines
(``None``: the payload goes through ``decode_batch``) or gives exactly the codec's
``EventBatch``; it never takes a payload the codec refuses.

Block keys: the core's XXH3 against the xxhash package on every length it takes (0-240
bytes), and its chained keys against ``block_keys``.

Tracker: two trackers, one with ``columnar_decode`` and one without, fed the same messages
(plain traffic mixed with every event the fast path hands back: LoRA, salts, media, offload
tiers, hybrid groups, other block sizes, unknown parents, bounds, undecodable payloads)
produce the same ops, tier ops, stats and ledgers after every message.
"""

from __future__ import annotations

import json
import random
from array import array
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine, block_keys
from cortex.ingest.columnar import decode_columnar, materialize, packed_block_keys
from cortex.ingest.ops import SourceId
from cortex.ingest.tracker import SourceTracker, TrackerConfig
from cortex.kvevents.codec import (
    ENCODER_VERSIONS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CodecError,
    Event,
    EventBatch,
    decode_batch,
    encode_batch,
)
from cortex.ledger import cores
from cortex.ledger._core import block_keys_packed, xxh3_64_short

from ..kvevents.test_codec_fuzz import mutated

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parents[1] / "kvevents" / "data"
GOLDEN = [
    (bytes.fromhex(g["payload_hex"]), Engine(g["engine"]), g["note"])
    for name in ("kv_event_payloads.json", "kv_event_payloads_2026.json")
    for g in json.loads((DATA / name).read_text())
]

FUZZ = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(autouse=True)
def native_core() -> Any:
    """The compiled core active (the fast path runs only then), whatever a test before set."""
    assert cores.Core.NATIVE in cores.available(), "the compiled core is not built"
    before = cores.active()
    cores.use(cores.Core.NATIVE)
    yield
    cores.use(before)


def same(payload: bytes, engine: Engine) -> bool:
    """Whether the compiled decoder took ``payload``; when it did, its batch is the codec's."""
    fast = decode_columnar(payload, engine)
    try:
        spec: EventBatch | None = decode_batch(payload, engine)
    except CodecError:
        spec = None
    if fast is None:
        return False
    assert spec is not None, "the compiled decoder took a payload decode_batch refuses"
    got = materialize(fast)
    assert got == spec
    assert type(got.ts) is float and type(got.dp_rank) is type(spec.dp_rank)
    assert len(got.events) == len(spec.events)
    for mine, theirs in zip(got.events, spec.events, strict=True):
        assert type(mine) is type(theirs)
        if not isinstance(mine, AllBlocksCleared):
            assert mine.group_idx_nil == theirs.group_idx_nil  # type: ignore[union-attr]
            assert [type(h) for h in mine.block_hashes] == [
                type(h) for h in theirs.block_hashes]  # type: ignore[union-attr]
    return True


# ---- the decoder ---------------------------------------------------------------------------


def test_golden_payloads_of_the_common_shapes_take_the_compiled_decoder() -> None:
    declined = [note for payload, engine, note in GOLDEN if not same(payload, engine)]
    # what it leaves to Python: speculative decoding, sliding windows, SGLang's cache salt
    assert len(declined) == 6, declined
    assert all(("lookahead" in note or "bigram" in note or "sliding-window" in note
                or "full batch" in note) for note in declined), declined


HASH_FORMATS = [(-(2**63), 2**63), (0, 2**64)]
"""SGLang's int64 hashes, vLLM's uint64."""


def test_every_engine_version_of_the_codec_takes_it() -> None:
    rng = random.Random(7)
    for engine, versions in ENCODER_VERSIONS.items():
        for version in versions:
            events: list[Event] = []
            for _ in range(6):
                blocks = rng.randrange(0, 5)
                low, high = rng.choice(HASH_FORMATS)  # one event's hashes: one format
                events.append(BlockStored(
                    tuple(rng.randrange(low, high) for _ in range(blocks)),
                    rng.choice([None, rng.randrange(2**64)]),
                    tuple(rng.randrange(2**32) for _ in range(blocks * 4)), 4,
                    medium=rng.choice([None, "GPU", "CPU"]) if version > "0.1" else None))
                events.append(BlockRemoved(
                    tuple(rng.randrange(2**64) for _ in range(rng.randrange(0, 3))),
                    medium=rng.choice([None, "GPU"])))
                if rng.random() < 0.2:
                    events.append(AllBlocksCleared())
            payload = encode_any(events, engine, version)
            assert same(payload, engine), (engine, version)


def encode_any(events: list[Event], engine: Engine, version: str, ts: float = 1.5) -> bytes:
    """The events as ``version`` publishes them, without the fields it lacks."""
    for rank in (0, None):
        for plain in (False, True):
            chosen = [BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids,
                                  e.block_size) if plain and isinstance(e, BlockStored)
                      else BlockRemoved(e.block_hashes) if plain and isinstance(e, BlockRemoved)
                      else e for e in events]
            try:
                return encode_batch(EventBatch(ts, tuple(chosen), rank), engine, version)
            except CodecError:
                continue
    raise AssertionError(f"{engine} {version} cannot carry these events")


def test_every_truncation_declines_or_agrees() -> None:
    for payload, engine, _ in GOLDEN:
        for end in range(len(payload)):
            same(payload[:end], engine)
            same(payload[:end], Engine.SGLANG if engine is Engine.VLLM else Engine.VLLM)


ENGINES = st.sampled_from([Engine.VLLM, Engine.SGLANG])


@FUZZ
@given(payload=mutated([g[0] for g in GOLDEN]), engine=ENGINES)
def test_mutated_golden_payloads(payload: bytes, engine: Engine) -> None:
    same(payload, engine)


@FUZZ
@given(payload=st.binary(max_size=300), engine=ENGINES)
def test_random_bytes(payload: bytes, engine: Engine) -> None:
    same(payload, engine)


# Batches of the common shapes, each field now and then replaced by a near miss.
INT64 = st.integers(-(2**63), 2**64 - 1)
near_miss = (
    st.none() | st.booleans() | st.floats(width=32) | st.text(max_size=4) | st.binary(max_size=4)
    | st.integers(-(2**63), 2**64 - 1) | st.lists(st.integers(-3, 3), max_size=3)
    | st.lists(st.lists(st.integers(0, 9), max_size=2), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2)
    | st.lists(st.none() | st.text(max_size=2), max_size=3)
)
common = {
    "block_hashes": st.lists(INT64, max_size=4),
    "parent_block_hash": st.none() | INT64,
    "token_ids": st.lists(st.integers(0, 2**32 - 1) | st.sampled_from([0, 2**32 - 1]),
                          max_size=12),
    "block_size": st.integers(0, 4) | st.sampled_from([2**32 - 1, 2**32, -1, 1, 2]),
    "lora_id": st.none(),
    "medium": st.none() | st.sampled_from(["GPU", "CPU", "gpu", "DISK", "é"]),
    "lora_name": st.none(),
    "cache_salt": st.none(),
    "extra_keys": st.none() | st.lists(st.none(), max_size=4),
    "group_idx": st.none() | st.integers(0, 3) | st.sampled_from([2**32 - 1, 2**32]),
    "kv_cache_spec_kind": st.none() | st.sampled_from(["full_attention", "mamba"]),
    "kv_cache_spec_sliding_window": st.none(),
    "locality": st.none() | st.sampled_from(["local", "remote"]),
    "ownership": st.none() | st.sampled_from(["owned", "shared"]),
    "session_id": st.none() | st.text(max_size=3),
    "lookahead_token_ids": st.none(),
}
STORED_MAP = list(common)
REMOVED_MAP = ["block_hashes", "medium", "group_idx", "locality", "ownership"]


@st.composite
def field(draw: st.DrawFn, name: str) -> Any:
    if draw(st.integers(0, 60)) == 0:
        return draw(near_miss)
    return draw(common[name])


@st.composite
def event(draw: st.DrawFn, engine: Engine) -> Any:
    tag = draw(st.sampled_from(["BlockStored"] * 6 + ["BlockRemoved"] * 6
                               + ["AllBlocksCleared", "AllBlocksCleared", "Other"]))
    names = STORED_MAP if tag == "BlockStored" else REMOVED_MAP
    if draw(st.booleans()):  # a map (vLLM >= 0.24, SGLang >= 0.5.20)
        required = ["block_hashes", "token_ids", "block_size"] if tag == "BlockStored" else [
            "block_hashes"]
        keys = [*required, *draw(st.lists(st.sampled_from(names), unique=True))]
        if draw(st.integers(0, 30)) == 0:
            keys.remove(draw(st.sampled_from(required)))  # a field Python requires
        out: dict[Any, Any] = {"type": tag}
        out.update({name: draw(field(name)) for name in keys})
        if draw(st.integers(0, 20)) == 0:
            out[draw(st.sampled_from(["unknown", 7, "type"]))] = draw(near_miss)
        return out
    order = {
        (Engine.VLLM, "BlockStored"): ["block_hashes", "parent_block_hash", "token_ids",
                                       "block_size", "lora_id", "medium", "lora_name",
                                       "extra_keys", "group_idx", "kv_cache_spec_kind",
                                       "kv_cache_spec_sliding_window", "locality",
                                       "ownership", "session_id", "lookahead_token_ids"],
        (Engine.SGLANG, "BlockStored"): ["block_hashes", "parent_block_hash", "token_ids",
                                         "block_size", "lora_id", "medium", "cache_salt",
                                         "session_id", "lora_name"],
        (Engine.VLLM, "BlockRemoved"): REMOVED_MAP,
        (Engine.SGLANG, "BlockRemoved"): ["block_hashes", "medium"],
    }.get((engine, tag), [])
    width = draw(st.integers(min(3, len(order)), len(order) + 1))
    values = [draw(field(name)) for name in order[:width]]
    if width > len(order):
        values.append(draw(near_miss))
    return [tag, *values]


@st.composite
def batch(draw: st.DrawFn) -> tuple[bytes, Engine]:
    engine = draw(ENGINES)
    events = draw(st.lists(event(engine), max_size=6))
    ts = draw(st.floats(0, 2e9) | st.integers(-5, 2**64 - 1) if draw(st.integers(0, 9))
              else near_miss)
    parts: list[Any] = [ts, events]
    if draw(st.booleans()):
        parts.append(draw(st.none() | st.integers(0, 2**32) if draw(st.integers(0, 9))
                          else near_miss))
    if draw(st.integers(0, 20)) == 0:
        parts.append(0)
    packed = msgpack.packb(parts, use_bin_type=True,
                           use_single_float=draw(st.integers(0, 9)) == 0)
    if draw(st.integers(0, 30)) == 0:
        packed += b"\x00"  # trailing bytes
    return packed, engine


@FUZZ
@given(case=batch())
def test_generated_batches(case: tuple[bytes, Engine]) -> None:
    same(*case)


def test_generated_batches_mostly_take_the_compiled_decoder() -> None:
    """The near misses are rare enough that the fuzzing above walks the success paths."""
    taken = runs = 0

    @settings(FUZZ, max_examples=200)
    @given(case=batch())
    def run(case: tuple[bytes, Engine]) -> None:
        nonlocal taken, runs
        runs += 1
        taken += same(*case)

    run()
    assert runs >= 100 and taken >= 0.05 * runs, (taken, runs)


@pytest.mark.parametrize("engine", list(Engine))
def test_hashes_come_as_arrays_of_their_format_and_a_mixed_event_goes_to_python(
        engine: Engine) -> None:
    unsigned, signed = (2**64 - 5, 7), (-(2**63), 7)
    stored = [BlockStored(hashes, None, tuple(range(8)), 4) for hashes in (unsigned, signed)]
    removed = [BlockRemoved(hashes) for hashes in (unsigned, unsigned, signed, (1,), unsigned)]
    version = ENCODER_VERSIONS[engine][-1]
    batch = decode_columnar(encode_any([*stored, *removed], engine, version), engine)
    assert batch is not None
    arrays = [event[1] for event in batch[2]]
    assert [(a.typecode, list(a)) for a in arrays] == [
        ("Q", list(unsigned)), ("q", list(signed)),
        ("Q", list(unsigned) * 2), ("q", [*signed, 1]), ("Q", list(unsigned))]  # runs split
    mixed = encode_any([BlockStored((-1, 2**64 - 1), None, tuple(range(8)), 4)], engine, version)
    assert decode_columnar(mixed, engine) is None
    assert same(encode_any([*stored, *removed], engine, version), engine)


def test_declines_without_the_compiled_core() -> None:
    payload = GOLDEN[0][0]
    assert decode_columnar(payload, Engine.VLLM) is not None
    cores.use(cores.Core.PYTHON)
    assert decode_columnar(payload, Engine.VLLM) is None


# ---- block keys ----------------------------------------------------------------------------


def test_xxh3_in_the_core_is_xxhash_on_every_short_length() -> None:
    rng = random.Random(3)
    for length in range(241):
        for seed in (0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, rng.randrange(2**64)):
            data = rng.randbytes(length)
            assert xxh3_64_short(data, seed) == xxhash.xxh3_64_intdigest(data, seed), length
    with pytest.raises(ValueError):
        xxh3_64_short(bytes(241), 0)


@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 5, 16, 17, 32, 33, 60, 61, 64])
def test_packed_block_keys_are_block_keys(block_size: int) -> None:
    rng = random.Random(block_size)
    for _ in range(20):
        tokens = [rng.randrange(2**32)
                  for _ in range(block_size * rng.randrange(6) + rng.randrange(block_size))]
        parent = rng.randrange(2**64)
        packed = array("I", tokens).tobytes()
        assert packed_block_keys(packed, block_size, parent) == block_keys(
            tokens, block_size, parent)
    assert (block_keys_packed(b"", block_size, 0) is None) == (block_size > 60)


# ---- the tracker ---------------------------------------------------------------------------


class Pair:
    """A tracker with the compiled decoder and one without, fed the same messages."""

    def __init__(self, engine: Engine, block_size: int | None, bound: int = 0,
                 lookahead: int | None = None) -> None:
        self.trackers = [
            SourceTracker(SourceId("w", 0), TrackerConfig(
                engine=engine, model="m", block_size=block_size, align_every=3,
                kv_lookahead=lookahead, columnar_decode=columnar))
            for columnar in (True, False)
        ]
        for tracker in self.trackers:
            tracker.start()
            if bound:
                tracker.bound(bound)
        self.seq = 0

    def send(self, payload: bytes) -> None:
        for tracker in self.trackers:
            tracker.on_message(self.seq, payload)
        self.seq += 1
        fast, slow = self.trackers
        assert fast.take_ops() == slow.take_ops()
        assert fast.take_tier_ops() == slow.take_tier_ops()
        assert fast.stats == slow.stats
        assert (fast.state, fast.reason) == (slow.state, slow.reason)
        assert fast.keymap.ledgers.keys() == slow.keymap.ledgers.keys()
        for tier, ledger in fast.keymap.ledgers.items():
            other = slow.keymap.ledgers[tier]
            assert ledger.pairs() == other.pairs()
            assert ledger.hashes() == other.hashes()
            assert [ledger.key_of(h) for h in ledger.hashes()] == [
                other.key_of(h) for h in other.hashes()]
        assert fast.keymap.misaligned == slow.keymap.misaligned
        assert (fast.keymap.hybrid is None) == (slow.keymap.hybrid is None)


BS = 4


class Engine_:
    """An engine's cache of chains, emitting the events of a random workload."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.chains: list[list[int]] = []  # engine hashes, chain by chain
        self.next_hash = 1

    def hashes(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        return out

    def store(self, **extra: Any) -> BlockStored:
        rng = self.rng
        blocks = rng.randrange(1, 5)
        hashes = self.hashes(blocks)
        if self.chains and rng.random() < 0.5:
            chain = rng.choice(self.chains)
            parent: int | None = chain[-1] if rng.random() < 0.9 else 10**9 + rng.randrange(9)
            chain.extend(hashes)
        else:
            parent = None
            self.chains.append(list(hashes))
        if rng.random() < 0.05 and self.chains:  # an engine hash reused for other tokens
            hashes = (rng.choice(self.chains)[0], *hashes[1:])
        tokens = tuple(rng.randrange(50) for _ in range(blocks * BS))
        return BlockStored(hashes, parent, tokens, BS, **extra)

    def remove(self, **extra: Any) -> BlockRemoved:
        rng = self.rng
        chain = rng.choice(self.chains) if self.chains else [12345]
        count = min(len(chain), rng.randrange(1, 3))
        taken = tuple(chain[-count:]) if rng.random() < 0.9 else (777_777,)
        return BlockRemoved(taken, **extra)


def odd_event(rng: random.Random, engine: Engine_, kind: Engine, sticky: bool) -> Event:
    """Something the fast path hands back to the codec's path (``sticky``: also what ends
    the fast path for the source: a hybrid model's second group, another block size)."""
    choice = rng.randrange(12)
    if choice in (4, 5, 7) and not sticky:
        choice = 0
    if choice == 0:
        return engine.store(lora_id=3, lora_name="adapter")
    if choice == 1:
        return engine.store(medium="CPU")
    if choice == 2:
        stored = engine.store(medium="CPU")
        return BlockStored(stored.block_hashes, None, (), 0, medium="CPU")
    if choice == 3:
        return engine.remove(medium="CPU")
    if choice == 4 and kind is Engine.VLLM:
        return engine.store(group_idx=1, kv_cache_spec_kind="mamba")
    if choice == 5 and kind is Engine.VLLM:
        return engine.remove(group_idx=1)
    if choice == 6:
        stored = engine.store()
        return BlockStored(stored.block_hashes, stored.parent_block_hash,
                           stored.token_ids[:-1], BS)  # a token short
    if choice == 7:
        stored = engine.store()
        return BlockStored(stored.block_hashes, stored.parent_block_hash,
                           stored.token_ids * 2, 2 * BS)  # another block size
    if choice == 8 and kind is Engine.VLLM:
        return engine.store(extra_keys=(("salt-1",),))
    if choice == 9 and kind is Engine.SGLANG:
        return engine.store(cache_salt="s")
    if choice == 10:
        return engine.store(medium="NVME")  # a medium Cortex does not know
    return AllBlocksCleared()


def stream(seed: int, kind: Engine, version: str, odd: float, sticky: bool) -> list[bytes]:
    rng = random.Random(seed)
    engine = Engine_(rng)
    out = []
    for step in range(120):
        events: list[Event] = []
        for _ in range(rng.randrange(1, 6)):
            roll = rng.random()
            if roll < odd:
                events.append(odd_event(rng, engine, kind, sticky))
            elif roll < 0.55:
                events.append(engine.store(medium=rng.choice([None, "GPU", "gpu"])
                                           if version >= "0.11" else None))
            else:
                for _ in range(rng.randrange(1, 4)):  # vLLM: one event per evicted block
                    events.append(engine.remove())
        payload = encode_any(events, kind, version, float(step))
        if rng.random() < 0.03:
            payload = payload[: rng.randrange(len(payload))]  # undecodable
        out.append(payload)
    return out


@pytest.mark.parametrize("kind,version", [(Engine.VLLM, "0.33.0"), (Engine.VLLM, "0.11.0"),
                                          (Engine.SGLANG, "0.5.23"), (Engine.SGLANG, "0.5.9")])
@pytest.mark.parametrize("seed", range(6))
def test_tracker_same_with_and_without_the_compiled_decoder(kind: Engine, version: str,
                                                             seed: int) -> None:
    odd = [0.0, 0.02, 0.1, 0.3, 0.1, 0.05][seed]
    block_size = None if seed % 3 == 1 else BS
    pair = Pair(kind, block_size, bound=60 if seed == 4 else 0,
                lookahead=None if seed == 5 else 0)
    for payload in stream(seed, kind, version, odd, sticky=seed == 3):
        pair.send(payload)
    fast = pair.trackers[0]
    assert fast.stats.batches > 100 and fast.stats.events.get("BlockStored", 0) > 50
