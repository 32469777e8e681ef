"""ZMQ frame helpers: round trips, both replay formats, end markers, bad frames, and the
frames as real ZMQ sockets deliver them (inproc, no ports)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.hashing import Engine
from cortex.kvevents.codec import CodecError
from cortex.kvevents.frames import (
    REPLAY_END_SEQ,
    PubMessage,
    ReplayEnd,
    ReplayItem,
    parse_pub,
    parse_replay_reply,
    parse_replay_request,
    parse_version,
    pub_frames,
    replay_end_frames,
    replay_has_topic,
    replay_reply_frames,
    replay_request,
)

pytestmark = pytest.mark.timeout(30)

seqs = st.integers(0, REPLAY_END_SEQ - 1)


@settings(max_examples=100, derandomize=True, database=None)
@given(topic=st.binary(max_size=20), seq=seqs, payload=st.binary(max_size=64))
def test_pub_round_trip(topic: bytes, seq: int, payload: bytes) -> None:
    frames = pub_frames(topic, seq, payload)
    assert frames[1] == seq.to_bytes(8, "big")
    assert parse_pub(frames) == PubMessage(topic=topic, seq=seq, payload=payload)


@settings(max_examples=100, derandomize=True, database=None)
@given(seq=seqs, payload=st.binary(max_size=64), topic=st.none() | st.binary(max_size=20))
def test_replay_reply_round_trip_in_both_formats(
    seq: int, payload: bytes, topic: bytes | None
) -> None:
    frames = replay_reply_frames(seq, payload, topic)
    assert len(frames) == (3 if topic is None else 4)
    assert parse_replay_reply(frames) == ReplayItem(seq=seq, payload=payload, topic=topic)


def test_replay_request_round_trip() -> None:
    assert replay_request(5) == [b"", b"\x00" * 7 + b"\x05"]
    assert parse_replay_request(replay_request(2**63 + 1)) == 2**63 + 1


def test_end_markers_match_the_engines_bytes() -> None:
    assert replay_end_frames(with_topic=True) == [b"", b"", b"\xff" * 8, b""]
    assert replay_end_frames(with_topic=False) == [b"", b"\xff" * 8, b""]
    assert parse_replay_reply(replay_end_frames(True)) == ReplayEnd(with_topic=True)
    assert parse_replay_reply(replay_end_frames(False)) == ReplayEnd(with_topic=False)
    # Detected by the seq frame alone, whatever else the marker carries.
    assert isinstance(parse_replay_reply([b"", b"topic", b"\xff" * 8, b"x"]), ReplayEnd)


def test_pub_frames_accept_zmq_frames_and_buffers() -> None:
    frames = [zmq.Frame(b"kv"), bytearray(b"\x00" * 7 + b"\x09"), memoryview(b"payload")]
    assert parse_pub(frames) == PubMessage(b"kv", 9, b"payload")  # type: ignore[arg-type]


BAD_PUB = {
    "two frames": [b"", b"\x00" * 8],
    "four frames": [b"", b"\x00" * 8, b"p", b"q"],
    "short seq": [b"", b"\x00" * 7, b"p"],
    "long seq": [b"", b"\x00" * 9, b"p"],
    "end seq on the live stream": [b"", b"\xff" * 8, b"p"],
}


@pytest.mark.parametrize("frames", BAD_PUB.values(), ids=BAD_PUB.keys())
def test_bad_pub_messages(frames: list[bytes]) -> None:
    with pytest.raises(CodecError):
        parse_pub(frames)


BAD_REPLY = {
    "empty": [],
    "no delimiter": [b"x", b"\x00" * 8, b"p"],
    "two frames": [b"", b"\x00" * 8],
    "five frames": [b"", b"t", b"\x00" * 8, b"p", b"q"],
    "short seq": [b"", b"\x00" * 4, b"p"],
    "short seq with topic": [b"", b"t", b"\x00" * 4, b"p"],
}


@pytest.mark.parametrize("frames", BAD_REPLY.values(), ids=BAD_REPLY.keys())
def test_bad_replay_replies(frames: list[bytes]) -> None:
    with pytest.raises(CodecError):
        parse_replay_reply(frames)


@pytest.mark.parametrize(
    "frames", [[b"\x00" * 8], [b"x", b"\x00" * 8], [b"", b"\x00" * 3], [b"", b"", b""]]
)
def test_bad_replay_requests(frames: list[bytes]) -> None:
    with pytest.raises(CodecError):
        parse_replay_request(frames)


def test_non_buffer_frames_raise_codec_error() -> None:
    with pytest.raises(CodecError, match="bytes-like"):
        parse_pub([b"", 5, b""])  # type: ignore[list-item]


@pytest.mark.parametrize("seq", [-1, REPLAY_END_SEQ, 2**64, 1.0, True])
def test_builders_refuse_invalid_seq(seq: object) -> None:
    with pytest.raises(ValueError, match="seq"):
        pub_frames(b"", seq, b"")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seq"):
        replay_reply_frames(seq, b"", None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "version", "expected"),
    [
        (Engine.VLLM, "0.9.0", False),
        ("vllm", "0.25.1", False),
        ("vllm", "0.26.0", True),
        ("vllm", "0.26.0rc1", True),
        ("vllm", "v0.33.0", True),
        ("vllm", "1.0", True),
        (Engine.SGLANG, "0.4.7", False),
        ("sglang", "0.5.21", False),
        ("sglang", "0.5.22", True),
        ("sglang", "0.5.23.post1", True),
        ("sglang", "0.6", True),
    ],
)
def test_replay_has_topic(engine: Engine | str, version: str, expected: bool) -> None:
    assert replay_has_topic(engine, version) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0.5.22", (0, 5, 22)),
        ("v0.26.0", (0, 26, 0)),
        ("0.10.1.1", (0, 10, 1, 1)),
        ("0.11.0rc2", (0, 11, 0)),
        ("0.9.0+cu124", (0, 9, 0)),
        ("0.6.3.post1", (0, 6, 3)),
        (" 1 ", (1,)),
    ],
)
def test_parse_version(text: str, expected: tuple[int, ...]) -> None:
    assert parse_version(text) == expected


@pytest.mark.parametrize("text", ["", "latest", "v", ".1"])
def test_parse_version_refuses_non_versions(text: str) -> None:
    with pytest.raises(ValueError, match="version"):
        parse_version(text)


# --------------------------------------------------------------------------------------------
# Real sockets: the frames as ZMQ actually delivers them.


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.term()


def _recv(sock: zmq.Socket[bytes], timeout_ms: int = 2000) -> list[bytes]:
    assert sock.poll(timeout_ms), "no message within the deadline"
    return sock.recv_multipart()


@pytest.mark.parametrize("with_topic", [True, False])
def test_replay_over_router_and_dealer(
    context: zmq.Context[zmq.Socket[bytes]], with_topic: bool
) -> None:
    with context.socket(zmq.ROUTER) as router, context.socket(zmq.DEALER) as dealer:
        router.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.LINGER, 0)
        router.bind("inproc://replay")
        dealer.connect("inproc://replay")

        dealer.send_multipart(replay_request(7))
        identity, *request = _recv(router)
        assert parse_replay_request(request) == 7

        topic = b"kv-events" if with_topic else None
        for seq in (7, 8):
            router.send_multipart([identity, *replay_reply_frames(seq, b"p%d" % seq, topic)])
        router.send_multipart([identity, *replay_end_frames(with_topic)])

        replies = [parse_replay_reply(_recv(dealer)) for _ in range(3)]
    assert replies == [
        ReplayItem(7, b"p7", topic),
        ReplayItem(8, b"p8", topic),
        ReplayEnd(with_topic=with_topic),
    ]


def test_pub_over_pub_and_sub(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with context.socket(zmq.PUB) as pub, context.socket(zmq.SUB) as sub:
        pub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.LINGER, 0)
        pub.bind("inproc://events")
        sub.connect("inproc://events")
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        # A SUB misses messages sent before its subscription reaches the PUB (slow joiner):
        # publish until one arrives, bounded by attempts, instead of sleeping.
        for seq in range(200):
            pub.send_multipart(pub_frames(b"kv-events", seq, b"payload"))
            if sub.poll(10):
                break
        message = parse_pub(sub.recv_multipart(zmq.NOBLOCK))
    assert (message.topic, message.payload) == (b"kv-events", b"payload")
