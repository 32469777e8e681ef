"""The decision headers, built in one place for every answer: the gateway's own responses
(served, failed before a worker answered, rejected before routing) and the endpoint
picker's response-header mutation (``docs/api.md`` lists them).
"""

from __future__ import annotations

from cortex.gateway.routing.pairing import PDOutcome

__all__ = ["NOT_ROUTED", "decision_headers"]


def decision_headers(*, hit_tokens: int | None = None, worker: str | None = None,
                     mode: str | None = None, reason: str | None = None,
                     attempts: int | None = None, pd: PDOutcome | None = None,
                     pd_failed: bool = False) -> list[tuple[bytes, bytes]]:
    """The ``x-cortex-*`` headers of the fields given (``None``: the header is left out),
    in the order clients have always seen them. ``pd`` adds how a disaggregated model's
    request was served; ``pd_failed`` says it was not served at all."""
    headers: list[tuple[bytes, bytes]] = []
    if hit_tokens is not None:
        headers.append((b"x-cortex-cache-hit-tokens", str(hit_tokens).encode()))
    if worker is not None:
        headers.append((b"x-cortex-assigned-worker", worker.encode()))
    if mode is not None:
        headers.append((b"x-cortex-match-mode", mode.encode()))
    if reason is not None:
        headers.append((b"x-cortex-match-reason", reason.encode()))
    if attempts is not None:
        headers.append((b"x-cortex-attempts", str(attempts).encode()))
    if pd is not None:
        headers += [(b"x-cortex-pd", pd.mode.value.encode()),
                    (b"x-cortex-prefill-worker", (pd.prefill or "none").encode()),
                    (b"x-cortex-decode-worker", (pd.decode or "none").encode())]
    elif pd_failed:
        headers += [(b"x-cortex-pd", b"failed"), (b"x-cortex-prefill-worker", b"none"),
                    (b"x-cortex-decode-worker", b"none")]
    return headers


NOT_ROUTED = decision_headers(hit_tokens=0, worker="none", mode="none")
"""The headers of a request rejected before routing."""
