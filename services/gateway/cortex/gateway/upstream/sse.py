"""Server-sent events framing for a proxy (pure): forward event-aligned bytes, watch usage.

Network chunks do not align with events, so bytes are held only up to the last blank line;
complete events go out at once, untouched unless they must change:

* the usage-only chunk (``choices: []`` + ``usage``) the gateway asked for on the client's
  behalf is removed when the client did not ask for usage itself;
* the last data event before ``[DONE]`` is parsed once to read the engine's usage
  (``usage.prompt_tokens_details.cached_tokens``, or ``meta_info.cached_tokens`` for
  SGLang's native ``/generate``);
* with an :class:`EventRewrite` (prefill/decode: vLLM usage taken from the prefill leg,
  SGLang input logprobs merged), the events holding its marker are rewritten.

Parsing JSON per chunk is avoided: a cheap substring test selects the few events to parse.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cortex.gateway.http.messages import json_dumps, json_loads

__all__ = ["EventRewrite", "EventStreamCheck", "SSEForwarder", "cached_tokens_of",
           "first_event_error", "has_complete_event", "is_event_stream", "sse_error_event"]

_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_DONE = b"[DONE]"
_DONE_LINES = (b"data: [DONE]", b"data:[DONE]")
_FIELDS = (b"data:", b":", b"event:", b"id:", b"retry:")


_LINE = rb"(?:data: *(?:\{[^\n]*|\[DONE\])|(?::|event:|id:|retry:)[^\n]*)?"
_WELL_FORMED = re.compile(rb"(?:" + _LINE + rb"\r?\n)*" + _LINE)


def _well_formed(block: bytes) -> bool:
    """Whether every line of complete events is an SSE field and every data line holds a
    JSON object or ``[DONE]`` (what the engines' streams promise): a look at the start of
    each line (one C regex over the block), no parsing."""
    return _WELL_FORMED.fullmatch(block) is not None


def _events_end(data: bytes) -> int:
    """Where the complete events of ``data`` end (0: none is complete)."""
    end = 0
    for sep in _SEPARATORS:
        at = data.rfind(sep)
        if at >= 0:
            end = max(end, at + len(sep))
    return end


def is_event_stream(head: bytes) -> bool:
    """Whether a stream's first bytes can be the start of the engines' SSE: its complete
    events well formed, the partial one starting like a field."""
    end = _events_end(head)
    if not _well_formed(head[:end]):
        return False
    rest = head[end:].lstrip(b"\r\n")[:6]
    return not rest or any(rest.startswith(f) or f.startswith(rest) for f in _FIELDS)


class EventStreamCheck:
    """Whether a stream relayed chunk by chunk stays the engines' SSE (:func:`is_event_stream`
    over each chunk and the partial event before it; only that partial event is kept)."""

    def __init__(self) -> None:
        self._partial = b""

    def feed(self, chunk: bytes) -> bool:
        data = self._partial + chunk
        if not is_event_stream(data):
            return False
        self._partial = data[_events_end(data):]
        return True


def sse_error_event(message: str, code: str, kind: str = "server_error") -> bytes:
    """An in-stream error in the engines' shape, followed by ``[DONE]``."""
    payload = json_dumps({"error": {"message": message, "type": kind, "code": code}})
    return b"data: " + payload + b"\n\ndata: [DONE]\n\n"


def cached_tokens_of(obj: Any) -> int | None:
    """The engine's cached prompt tokens in a response object, or ``None`` if absent.

    OpenAI shape: ``usage.prompt_tokens_details.cached_tokens``; Responses:
    ``usage.input_tokens_details.cached_tokens``; Anthropic Messages:
    ``usage.cache_read_input_tokens``; SGLang native: ``meta_info.cached_tokens``. ``usage``
    present without details counts as 0 only for the caller to decide (``None`` here)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        for name in ("prompt_tokens_details", "input_tokens_details"):
            details = usage.get(name)
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                return int(details["cached_tokens"])
        if isinstance(usage.get("cache_read_input_tokens"), int):
            return int(usage["cache_read_input_tokens"])
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return int(meta["cached_tokens"])
    return None


@dataclass(frozen=True, slots=True)
class EventRewrite:
    """Change some response objects: a stream's data events whose bytes contain ``marker``
    (or a whole JSON body) are parsed, passed through ``apply`` and serialized again."""

    marker: bytes
    apply: Callable[[dict[str, Any]], dict[str, Any]]

    def body(self, data: bytes) -> bytes:
        """A non-streamed JSON body, rewritten (unchanged when it is not a JSON object)."""
        if self.marker not in data:
            return data
        obj = _json_of(data)
        return data if obj is None else json_dumps(self.apply(obj))


def first_event_error(data: bytes) -> dict[str, Any] | None:
    """The ``error`` object of the first complete data event in ``data``, if it is one.

    Engines that already sent their headers report a failure as the stream's first event
    (``data: {"error": {...}}``); before the first byte reached the client that is a failed
    attempt like any other."""
    for sep in _SEPARATORS:
        end = data.find(sep)
        if end >= 0:
            obj = _json_of(_data_of(data[:end]))
            if obj is not None and isinstance(obj.get("error"), dict):
                error: dict[str, Any] = obj["error"]
                return error
            return None
    return None


def has_complete_event(data: bytes) -> bool:
    """Whether ``data`` holds at least one complete event (a blank line)."""
    return any(sep in data for sep in _SEPARATORS)



def _is_done(block: bytes) -> bool:
    """Whether a ``data: [DONE]`` line is in ``block`` (at a line start: JSON strings cannot
    hold a raw newline, so generated text saying ``[DONE]`` does not count)."""
    # no generator: this runs once per relayed block (every streamed token)
    return (block.startswith(_DONE_LINES) or b"\ndata: [DONE]" in block
            or b"\ndata:[DONE]" in block)


def _json_of(data: bytes | None) -> dict[str, Any] | None:
    if not data:
        return None
    try:
        obj = json_loads(data)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _data_of(event: bytes) -> bytes | None:
    """The data of one event (multi-line data joined by newlines), or ``None``."""
    lines = [
        line[5:].lstrip(b" ")
        for line in event.replace(b"\r\n", b"\n").split(b"\n")
        if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


class SSEForwarder:
    """Feeds upstream bytes, returns bytes for the client; remembers usage and ``[DONE]``.

    ``strip_usage``: drop the usage-only chunk (the client did not ask for usage).
    ``rewrite``: applied to the events holding its marker, before usage is read or stripped.
    ``keep_bytes``: keep up to this many bytes of the forwarded events (:attr:`kept`, the
    answer fed to the tokenizer cache afterwards; ``None`` once the answer was longer).
    The common chunk costs a few substring searches: events are split and parsed only in
    the block that holds the usage chunk, ``[DONE]`` or the rewrite marker, or at the end.
    """

    def __init__(self, strip_usage: bool, rewrite: EventRewrite | None = None,
                 keep_bytes: int = 0) -> None:
        self.strip_usage = strip_usage
        self.rewrite = rewrite
        self.keep_bytes = keep_bytes
        self._kept: list[bytes] | None = [] if keep_bytes > 0 else None
        self._kept_size = 0
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.last_object: dict[str, Any] | None = None
        self.saw_error = False
        self.malformed = False  # an event that is not the engines' SSE went by
        self._buffer = b""
        self._last_block = b""  # the latest complete events, parsed only when needed
        self._parsed = True
        self._usage_stripped = False

    def feed(self, chunk: bytes) -> bytes:
        """Bytes of the complete events now available (possibly empty)."""
        buffer = self._buffer + chunk if self._buffer else chunk
        end = 0
        for sep in _SEPARATORS:
            at = buffer.rfind(sep)
            if at >= 0:
                end = max(end, at + len(sep))
        if end == 0:
            self._buffer = buffer
            return b""
        complete, self._buffer = buffer[:end], buffer[end:]
        return self._process(complete)

    @property
    def kept(self) -> bytes | None:
        """The forwarded events, when keeping was asked for and they fit."""
        return None if self._kept is None else b"".join(self._kept)

    def finish(self) -> bytes:
        """At upstream EOF: whatever partial event is left (forwarded as is)."""
        rest, self._buffer = self._buffer, b""
        out = self._process(rest) if rest.strip() else rest
        self._parse_last()
        return out

    @property
    def cached_tokens(self) -> int | None:
        self._parse_last()
        return cached_tokens_of(self.usage_holder)

    @property
    def usage_holder(self) -> dict[str, Any] | None:
        """What carries the engine's usage: the usage chunk, else the last data object."""
        self._parse_last()
        if self.usage is not None:
            return {"usage": self.usage}
        return self.last_object

    def _process(self, complete: bytes) -> bytes:
        if not _well_formed(complete):
            self.malformed = True
            return b""  # never relayed
        if b'"error"' in complete:
            self.saw_error = True
        out = complete
        if self.rewrite is not None and self.rewrite.marker in out:
            out = self._rewrite_block(out)
        if self.strip_usage and b'"usage"' in out:
            out = self._drop_usage_chunk(out)
        if _is_done(out):
            self._parse_last()  # the previous block may hold the last data event
            self._last_block, self._parsed = out, False
            self._parse_last()
            self.done = True
        elif b"data:" in out:  # comment-only blocks (keep-alives) do not replace data
            self._last_block, self._parsed = out, False
        if self._kept is not None:
            self._kept_size += len(out)
            if self._kept_size > self.keep_bytes:
                self._kept = None
            else:
                self._kept.append(out)
        return out

    def _rewrite_block(self, block: bytes) -> bytes:
        rewrite = self.rewrite
        assert rewrite is not None
        sep = b"\r\n\r\n" if b"\r\n\r\n" in block else b"\n\n"
        events = block.split(sep)
        for i, event in enumerate(events):
            if rewrite.marker not in event:
                continue
            obj = _json_of(_data_of(event))
            if obj is None:
                continue
            newline = b"\r\n" if sep == b"\r\n\r\n" else b"\n"
            others = [line for line in event.split(newline) if not line.startswith(b"data:")]
            events[i] = newline.join([*others, b"data: " + json_dumps(rewrite.apply(obj))])
        return sep.join(events)

    def _drop_usage_chunk(self, block: bytes) -> bytes:
        """``block`` without the usage-only chunk (whose usage is kept)."""
        for marker in _EMPTY_CHOICES:
            at = block.find(marker)
            if at >= 0:
                break
        else:
            return block
        sep = b"\r\n\r\n" if b"\r\n\r\n" in block else b"\n\n"
        start = block.rfind(sep, 0, at)
        start = 0 if start < 0 else start + len(sep)
        end = block.find(sep, at)
        end = len(block) if end < 0 else end + len(sep)
        obj = _json_of(_data_of(block[start:end]))
        if obj is None or obj.get("choices") != [] or not isinstance(obj.get("usage"), dict):
            return block
        self.usage = obj["usage"]
        self._usage_stripped = True
        return block[:start] + block[end:]

    def _parse_last(self) -> None:
        """Parse the last data event (not ``[DONE]``) of the latest block, once; not at all
        once the stripped usage chunk was read (the answer's last object, parsed already)."""
        if self._parsed:
            return
        self._parsed = True
        if self._usage_stripped:
            return
        block = self._last_block
        sep = b"\r\n\r\n" if b"\r\n\r\n" in block else b"\n\n"
        for event in reversed(block.split(sep)):
            data = _data_of(event)
            if not data or data == _DONE:
                continue
            obj = _json_of(data)
            if obj is not None:
                self.last_object = obj
                if isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
            return

    def __repr__(self) -> str:
        return f"SSEForwarder(done={self.done}, usage={self.usage is not None})"
