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
    """Kubernetes API server URL (default: the in-cluster one)."""
    namespace: str
    """Namespace of the worker pods (default: the service account's)."""
    redis_url: str
    """Registry Redis URL."""
    selector: str = "cortex/engine"
    """Label selector of the worker pods."""
    token_file: str | None = None
    """Bearer token file (default: the service account's)."""
    ca_file: str | None = None
    """CA bundle of the API server (default: the service account's)."""
    registry_namespace: str = DEFAULT_NAMESPACE
    """Registry key prefix."""
    lease_ttl_s: float = 10.0
    """Lease of a discovered worker, renewed every third."""
    tombstone_ttl_s: float = 300.0
    """A pod that left stays out this long."""
    watch_timeout_s: float = 300.0
    """Each watch is resumed after this long."""
    backoff_max_s: float = 30.0
    """Longest back-off after a failed list or watch."""
    metrics_host: str = "127.0.0.1"
    """Address of /metrics and /health."""
    metrics_port: int | None = 9466
    """HTTP port of /metrics and /health (0 = ephemeral, -1 or off = none)."""
    learn_from_engines: bool = False
    """Ask each Ready pod's engine what its annotations do not say (model, KV-event
    endpoints, block size...)."""
    learn_timeout_s: float = 5.0
    """Bound of one request to an engine."""

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
