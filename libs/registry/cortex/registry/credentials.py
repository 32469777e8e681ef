"""The headers that authenticate a Cortex process to a worker (the gateway's requests, the
ingest's capacity reads).

:class:`WorkerCredentials` resolves a worker spec's ``credential`` reference (``env:NAME``,
``file:/path``) into the ``Authorization`` header sent to that worker. The environment is a
snapshot taken at the edge (the CLI) and passed in; a file is re-read at most every
``reread_s`` seconds, so a rotated key takes effect without a restart. Resolved keys live
only in this object: never in a log line, a metric or an admin answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from cortex.registry.spec import WorkerSpec

__all__ = ["WorkerCredentials"]

log = logging.getLogger(__name__)


class WorkerCredentials:
    """Worker spec → the headers that authenticate this process to that worker."""

    def __init__(self, environ: Mapping[str, str], *, reread_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._environ = dict(environ)
        self._reread_s = reread_s
        self._clock = clock
        self._files: dict[str, tuple[float, str | None]] = {}  # path -> (read at, key)
        self._warned: set[str] = set()

    def headers(self, spec: WorkerSpec) -> dict[str, str]:
        """``{"Authorization": "Bearer <key>"}``, or ``{}`` without (or with an unresolvable)
        credential — the worker then refuses, which its breaker and probes report."""
        ref = spec.credential
        if ref is None:
            return {}
        key = self._resolve(ref)
        if key is None:
            if ref not in self._warned:
                self._warned.add(ref)
                log.warning("worker=%s credential %s does not resolve to a key", spec.id, ref,
                            extra={"worker": spec.id})
            return {}
        return {"Authorization": f"Bearer {key}"}

    def _resolve(self, ref: str) -> str | None:
        kind, _, where = ref.partition(":")
        if kind == "env":
            return self._environ.get(where) or None
        now = self._clock()
        cached = self._files.get(where)
        if cached is not None and now - cached[0] < self._reread_s:
            return cached[1]
        try:
            key: str | None = Path(where).read_text(encoding="utf-8").strip() or None
        except (OSError, UnicodeDecodeError):
            key = None
        self._files[where] = (now, key)
        return key

    def __repr__(self) -> str:
        return f"WorkerCredentials(files={len(self._files)})"
