"""ZMQ multipart frames of the KV-event transport (spec ``kv-events.md`` §1), socket-free.

Used by the ingest (SUB for the live stream, DEALER for replay) and by the simulator (PUB and
replay ROUTER). Builders return the frames to hand to ``send_multipart``; parsers take the
frames from ``recv_multipart`` and raise :class:`~cortex.kvevents.codec.CodecError` for anything
that is not a well-formed message (never another exception).

Live stream, PUB -> SUB: ``[topic, seq(8B BE), payload]``.
Replay, DEALER -> ROUTER: ``[b"", start_seq(8B BE)]``; the ROUTER answers one message per
buffered batch with ``seq >= start_seq``, then an end marker whose seq frame is eight ``ff``:

========================  ===========================================  =======================
engine versions           batch reply (as the DEALER receives it)      end marker
========================  ===========================================  =======================
vLLM >= 0.26, SGLang      ``[b"", topic, seq, payload]``               ``[b"", b"", ff*8, b""]``
>= 0.5.22
older                     ``[b"", seq, payload]``                      ``[b"", ff*8, b""]``
========================  ===========================================  =======================
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from cortex.hashing import Engine
from cortex.kvevents.codec import CodecError

__all__ = [
    "REPLAY_END_SEQ",
    "PubMessage",
    "ReplayEnd",
    "ReplayItem",
    "parse_pub",
    "parse_replay_reply",
    "parse_replay_request",
    "parse_version",
    "pub_frames",
    "replay_end_frames",
    "replay_has_topic",
    "replay_reply_frames",
    "replay_request",
]

REPLAY_END_SEQ: Final = 2**64 - 1
"""The seq value of the replay end marker (``-1`` as 8 signed bytes): never a batch's seq."""

_SEQ_BYTES: Final = 8
_END_FRAME: Final = REPLAY_END_SEQ.to_bytes(_SEQ_BYTES, "big")

# First engine version whose replay replies carry the topic frame.
_REPLAY_TOPIC_SINCE: Final = {Engine.VLLM: (0, 26), Engine.SGLANG: (0, 5, 22)}


@dataclass(frozen=True, slots=True)
class PubMessage:
    """One live-stream message: ``seq`` counts 0, 1, 2, ... per publisher process."""

    topic: bytes
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class ReplayItem:
    """One replayed batch; ``topic`` is ``None`` in the old (topic-less) reply format."""

    seq: int
    payload: bytes
    topic: bytes | None


@dataclass(frozen=True, slots=True)
class ReplayEnd:
    """The end of one replay answer; ``with_topic`` tells which reply format it came in."""

    with_topic: bool = False


# --------------------------------------------------------------------------------------------
# Builders (simulator and ingest requests). Misuse is a programming error: ValueError.


def pub_frames(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The PUB message ``[topic, seq, payload]`` for batch ``seq`` (0 <= seq < 2**64 - 1)."""
    return [bytes(topic), _seq_frame(seq), bytes(payload)]


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered batch with ``seq >= start_seq``."""
    return [b"", _seq_frame(start_seq)]


def replay_reply_frames(seq: int, payload: bytes, topic: bytes | None) -> list[bytes]:
    """One replayed batch as the ROUTER sends it, without the peer identity frame.

    ``topic=None`` builds the old format (vLLM < 0.26, SGLang < 0.5.22).
    """
    if topic is None:
        return [b"", _seq_frame(seq), bytes(payload)]
    return [b"", bytes(topic), _seq_frame(seq), bytes(payload)]


def replay_end_frames(with_topic: bool) -> list[bytes]:
    """The end marker closing one replay answer (without the peer identity frame)."""
    if with_topic:
        return [b"", b"", _END_FRAME, b""]
    return [b"", _END_FRAME, b""]


def _seq_frame(seq: int) -> bytes:
    if type(seq) is not int or not 0 <= seq < REPLAY_END_SEQ:
        raise ValueError(f"seq must be an int in [0, 2**64 - 1), got {seq!r}")
    return seq.to_bytes(_SEQ_BYTES, "big")


# --------------------------------------------------------------------------------------------
# Parsers (network input): CodecError only.


def parse_pub(frames: Sequence[bytes]) -> PubMessage:
    """Parse a live-stream message received on a SUB socket."""
    parts = _frames(frames, "PUB message")
    if len(parts) != 3:
        raise CodecError(f"PUB message must have 3 frames (topic, seq, payload), got {len(parts)}")
    topic, seq_frame, payload = parts
    seq = _seq(seq_frame, "PUB message")
    if seq == REPLAY_END_SEQ:
        raise CodecError("PUB message carries the reserved replay end seq ff*8")
    return PubMessage(topic=topic, seq=seq, payload=payload)


def parse_replay_request(frames: Sequence[bytes]) -> int:
    """The start seq of a replay request, from the frames after the ROUTER's identity frame."""
    parts = _frames(frames, "replay request")
    if len(parts) != 2 or parts[0]:
        raise CodecError("replay request must be [b'', start_seq (8 bytes)]")
    return _seq(parts[1], "replay request")


def parse_replay_reply(frames: Sequence[bytes]) -> ReplayItem | ReplayEnd:
    """Parse one reply received on the replay DEALER socket, in either format."""
    parts = _frames(frames, "replay reply")
    if not parts or parts[0]:
        raise CodecError("replay reply must start with an empty delimiter frame")
    topic: bytes | None
    if len(parts) == 3:
        topic, seq_frame, payload = None, parts[1], parts[2]
    elif len(parts) == 4:
        topic, seq_frame, payload = parts[1], parts[2], parts[3]
    else:
        raise CodecError(f"replay reply must have 3 or 4 frames, got {len(parts)}")
    seq = _seq(seq_frame, "replay reply")
    if seq == REPLAY_END_SEQ:
        return ReplayEnd(with_topic=topic is not None)
    return ReplayItem(seq=seq, payload=payload, topic=topic)


def _frames(frames: Sequence[bytes], what: str) -> list[bytes]:
    # recv_multipart(copy=False) yields zmq.Frame objects: accept any buffer, hand out bytes.
    # memoryview, unlike bytes(), refuses ints (bytes(5) would be five zero bytes).
    try:
        return [frame if type(frame) is bytes else memoryview(frame).tobytes() for frame in frames]
    except (TypeError, ValueError) as exc:
        raise CodecError(f"{what}: frames must be bytes-like ({exc})") from None


def _seq(frame: bytes, what: str) -> int:
    if len(frame) != _SEQ_BYTES:
        raise CodecError(f"{what}: seq frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


# --------------------------------------------------------------------------------------------
# Versions


_VERSION: Final = re.compile(r"v?(\d+(?:\.\d+)*)")


def parse_version(version: str) -> tuple[int, ...]:
    """``"0.5.22"`` -> ``(0, 5, 22)``; a leading ``v`` and any suffix after the numeric
    release (``rc1``, ``.post1``, ``+cu124``, ``.dev3``) are dropped. Raises ``ValueError``
    when the string does not start with a numeric release.
    """
    match = _VERSION.match(version.strip())
    if match is None:
        raise ValueError(f"not an engine version: {version!r}")
    return tuple(int(part) for part in match.group(1).split("."))


def replay_has_topic(engine: Engine | str, version: str) -> bool:
    """Whether replay replies carry the topic frame: vLLM >= 0.26, SGLang >= 0.5.22."""
    return parse_version(version) >= _REPLAY_TOPIC_SINCE[Engine(engine)]
