"""The engines' Anthropic Messages and OpenAI Responses streams, relayed untouched (pure).

Both are SSE of named events (``event: …`` + ``data: {…}``) without ``[DONE]``:

- Messages: ``message_start`` carries ``message.usage`` (vLLM: ``input_tokens`` less the
  cached ones, and ``cache_read_input_tokens`` when the engine reports details; SGLang: 0
  until the end), ``message_delta`` the final ``usage``, ``message_stop`` ends the stream;
- Responses: ``response.created`` carries the response id, ``response.completed`` /
  ``response.incomplete`` / ``response.failed`` the final ``response.usage``
  (``input_tokens_details.cached_tokens``) and end it.

An ``error`` event ends either. :class:`NamedEventStream` passes every byte on as it came,
checks that the stream stays SSE, and remembers the usage, the response id and the end.
"""

from __future__ import annotations

from typing import Any

from cortex.gateway.http.messages import json_loads
from cortex.gateway.upstream.sse import EventStreamCheck

__all__ = ["NamedEventStream"]

_ENDS = frozenset({"message_stop", "response.completed", "response.incomplete",
                   "response.failed", "error"})


class NamedEventStream:
    """Feeds upstream bytes, returns them unchanged; remembers usage, response id, end."""

    def __init__(self) -> None:
        self._check = EventStreamCheck()
        self._partial = b""
        self.usage: dict[str, Any] = {}
        self.response_id: str | None = None
        self.done = False
        self.malformed = False

    def feed(self, chunk: bytes) -> bytes:
        """``chunk`` as it came (``malformed`` set when the stream broke off SSE)."""
        if not self._check.feed(chunk):
            self.malformed = True
            return b""
        data = self._partial + chunk
        end = max((at + len(sep) for sep in (b"\n\n", b"\r\n\r\n")
                   if (at := data.rfind(sep)) >= 0), default=0)
        self._partial = data[end:]
        for line in data[:end].splitlines():
            if line.startswith(b"data:"):
                self._event(line[5:])
        return chunk

    def _event(self, data: bytes) -> None:
        try:
            obj = json_loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        kind = obj.get("type")
        if kind == "message_start" and isinstance(obj.get("message"), dict):
            self._usage(obj["message"].get("usage"))
        elif kind == "message_delta":
            self._usage(obj.get("usage"))
        elif isinstance(obj.get("response"), dict):
            response = obj["response"]
            found = response.get("id")
            if self.response_id is None and isinstance(found, str) and 0 < len(found) <= 256:
                self.response_id = found
            self._usage(response.get("usage"))
        if kind in _ENDS:
            self.done = True

    def _usage(self, usage: Any) -> None:
        if isinstance(usage, dict):
            self.usage.update(usage)

    @property
    def usage_holder(self) -> dict[str, Any] | None:
        """The engine's usage as a response object carries it (``None``: none seen)."""
        return {"usage": self.usage} if self.usage else None

    def __repr__(self) -> str:
        return (f"NamedEventStream(done={self.done}, usage={self.usage}, "
                f"response_id={self.response_id!r})")
