"""The pod discovery's one configuration object, validated on creation."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from cortex.registry.redis_registry import DEFAULT_NAMESPACE

__all__ = ["DiscoveryConfig"]


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """``api_url``: the API server (``https://host:port``; ``http://`` for tests);
    ``token_file`` / ``ca_file``: the service account's token (re-read on every request:
    kubelet rotates it) and the CA that signs the server's certificate. ``namespace`` and
    ``selector`` (a label selector) choose the worker pods. Leases last ``lease_ttl_s`` and
    are renewed every third of it; a pod that leaves is tombstoned for ``tombstone_ttl_s``.
    ``watch_timeout_s``: the server ends each watch after this long (it is then resumed);
    failures back off up to ``backoff_max_s``. ``metrics_port`` ``None``: no HTTP endpoint.
    ``learn_from_engines``: ask each Ready pod's engine what the pod's annotations do not
    say (model, KV-event endpoints, block size…), each request bounded by
    ``learn_timeout_s``.
    """

    api_url: str
    namespace: str
    redis_url: str
    selector: str = "cortex/engine"
    token_file: str | None = None
    ca_file: str | None = None
    registry_namespace: str = DEFAULT_NAMESPACE
    lease_ttl_s: float = 10.0
    tombstone_ttl_s: float = 300.0
    watch_timeout_s: float = 300.0
    backoff_max_s: float = 30.0
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9466
    learn_from_engines: bool = False
    learn_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        parts = urlsplit(self.api_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"api_url: {self.api_url!r} is not an http(s) URL")
        if not self.namespace:
            raise ValueError("namespace: required")
        for name in ("lease_ttl_s", "tombstone_ttl_s", "watch_timeout_s", "backoff_max_s",
                     "learn_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in 0..65535, got {self.metrics_port}")

    @property
    def discovered_by(self) -> str:
        """The label value that marks the workers this discovery registered."""
        return f"kubernetes:{self.namespace}:{self.selector}"
