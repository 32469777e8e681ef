"""Server-sent events framing for a proxy (pure): forward event-aligned bytes, watch usage.

Network chunks do not align with events, so bytes are held only up to the last blank line;
complete events go out at once, untouched unless they must change:

* the usage-only chunk (``choices: []`` + ``usage``) the gateway asked for on the client's
  behalf is removed when the client did not ask for usage itself;
* the last data event before ``[DONE]`` is parsed once to read the engine's usage
  (``usage.prompt_tokens_details.cached_tokens``, or ``meta_info.cached_tokens`` for
  SGLang's native ``/generate``).

Parsing JSON per chunk is avoided: a cheap substring test selects the few events to parse.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SSEForwarder", "cached_tokens_of", "sse_error_event"]

_SEPARATORS = (b"\n\n", b"\r\n\r\n")
_EMPTY_CHOICES = (b'"choices":[]', b'"choices": []')
_DONE = b"[DONE]"


def sse_error_event(message: str, code: str, kind: str = "server_error") -> bytes:
    """An in-stream error in the engines' shape, followed by ``[DONE]``."""
    payload = json.dumps({"error": {"message": message, "type": kind, "code": code}})
    return b"data: " + payload.encode() + b"\n\ndata: [DONE]\n\n"


def cached_tokens_of(obj: Any) -> int | None:
    """The engine's cached prompt tokens in a response object, or ``None`` if absent.

    OpenAI shape: ``usage.prompt_tokens_details.cached_tokens``; SGLang native:
    ``meta_info.cached_tokens``. ``usage`` present without details counts as 0 only for the
    caller to decide (``None`` here)."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return int(details["cached_tokens"])
    meta = obj.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return int(meta["cached_tokens"])
    return None


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
    """

    def __init__(self, strip_usage: bool) -> None:
        self.strip_usage = strip_usage
        self.done = False
        self.events = 0
        self.usage: dict[str, Any] | None = None
        self.last_object: dict[str, Any] | None = None
        self.saw_error = False
        self._buffer = b""
        self._last_data: bytes | None = None

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
        if self.usage is not None:
            return {"usage": self.usage}
        return self.last_object

    def _process(self, complete: bytes) -> bytes:
        sep = b"\r\n\r\n" if b"\r\n\r\n" in complete else b"\n\n"
        events = [e for e in complete.split(sep) if e.strip()]
        self.events += len(events)
        needs_rewrite = self.strip_usage and any(m in complete for m in _EMPTY_CHOICES)
        if b'"error"' in complete:
            self.saw_error = True
        kept: list[bytes] = []
        for event in events:
            data = _data_of(event)
            if data is None:
                kept.append(event)
                continue
            if data == _DONE:
                self._parse_last()
                self.done = True
                kept.append(event)
                continue
            self._last_data = data
            if needs_rewrite and any(m in data for m in _EMPTY_CHOICES) and b'"usage"' in data:
                self._parse_last()
                if self.usage is not None:
                    continue  # the usage-only chunk the client did not ask for
            kept.append(event)
        if len(kept) == len(events):
            return complete
        return b"".join(e + sep for e in kept)

    def _parse_last(self) -> None:
        data, self._last_data = self._last_data, None
        if data is None:
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        self.last_object = obj
        if isinstance(obj.get("usage"), dict):
            self.usage = obj["usage"]

    def __repr__(self) -> str:
        return (
            f"SSEForwarder(events={self.events}, done={self.done},"
            f" usage={self.usage is not None})"
        )
