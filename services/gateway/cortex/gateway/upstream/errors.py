"""How a call to a worker failed: :class:`UpstreamFailure` and its :class:`FailureKind`, the
one exception both upstream clients raise (their libraries' errors end at them)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["FailureKind", "UpstreamFailure"]


class FailureKind(StrEnum):
    CONNECT = "connect"
    TIMEOUT = "timeout"
    STATUS = "status"
    DISCONNECT = "disconnect"
    PROTOCOL = "protocol"
    WEDGED = "wedged"  # no first byte nor engine progress, probe unanswered (dispatch.attempt)
    BAD_ANSWER = "bad_answer"  # a 200 whose body is not what the endpoint promises
    TOO_LARGE = "too_large"  # an answer over upstream.max_answer_bytes


class UpstreamFailure(Exception):
    """A worker call failed; ``kind`` says how (``status``: the HTTP status it answered,
    ``retry_after_s``: its ``Retry-After``). Internal: never shown to clients as is."""

    def __init__(self, kind: FailureKind, detail: str, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s
