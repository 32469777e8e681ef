"""ZMQ endpoints of a worker's KV-event publisher, and their per-DP-rank variants.

Both engines publish data-parallel rank ``r`` on ``port + r`` (PUB and replay alike). An
endpoint registered with a wildcard host (``*``, ``0.0.0.0``, ``::``) means "the worker's
own host", which is how engines advertise what they bind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from cortex.registry.errors import SpecError

__all__ = ["Endpoint", "Transport", "parse_endpoint"]

_WILDCARDS = frozenset({"*", "0.0.0.0", "::", "[::]"})
_TCP = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>[0-9]{1,5})$")
_HOSTNAME = re.compile(r"^(\*|[A-Za-z0-9]([A-Za-z0-9._-]{0,252}))$")
MAX_PORT = 65535


class Transport(StrEnum):
    TCP = "tcp"
    IPC = "ipc"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A parsed ZMQ endpoint: ``tcp://host:port`` or ``ipc://path``."""

    transport: Transport
    host: str  # tcp: host name / IPv4 / bracketed IPv6; ipc: the path
    port: int | None = None  # tcp only

    def __str__(self) -> str:
        if self.transport is Transport.IPC:
            return f"ipc://{self.host}"
        return f"tcp://{self.host}:{self.port}"

    @property
    def is_wildcard(self) -> bool:
        return self.transport is Transport.TCP and self.host in _WILDCARDS

    def at_host(self, worker_host: str) -> Endpoint:
        """Where a subscriber reaches this endpoint: a wildcard (bind) host replaced by
        ``worker_host`` (the host of the worker's URL, IPv6 with or without brackets)."""
        if not self.is_wildcard:
            return self
        if ":" in worker_host and not worker_host.startswith("["):
            worker_host = f"[{worker_host}]"
        return Endpoint(self.transport, worker_host, self.port)

    def for_rank(self, rank: int, worker_host: str) -> str:
        """The endpoint a subscriber connects to for DP rank ``rank`` (port + rank), a
        wildcard host reached at ``worker_host`` (:meth:`at_host`)."""
        if self.transport is Transport.IPC:
            if rank != 0:
                raise SpecError(f"ipc endpoint {self} cannot serve DP rank {rank}")
            return str(self)
        reached = self.at_host(worker_host)
        assert reached.port is not None
        return f"tcp://{reached.host}:{reached.port + rank}"


def parse_endpoint(text: str, *, what: str = "endpoint") -> Endpoint:
    """Parse ``tcp://HOST:PORT`` or ``ipc://PATH``; :class:`SpecError` with a clear message."""
    if text.startswith("ipc://"):
        path = text[len("ipc://") :]
        if not path or any(ch.isspace() for ch in path):
            raise SpecError(f"{what}: bad ipc endpoint {text!r} (expected ipc://PATH)")
        return Endpoint(Transport.IPC, path)
    match = _TCP.match(text)
    if match is None:
        raise SpecError(f"{what}: bad endpoint {text!r} (expected tcp://HOST:PORT or ipc://PATH)")
    host, port = match["host"], int(match["port"])
    if not host.startswith("[") and _HOSTNAME.match(host) is None:
        raise SpecError(f"{what}: bad host {host!r} in {text!r}")
    if not 1 <= port <= MAX_PORT:
        raise SpecError(f"{what}: port {port} out of range 1..{MAX_PORT} in {text!r}")
    return Endpoint(Transport.TCP, host, port)
