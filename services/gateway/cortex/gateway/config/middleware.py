"""Config sections of the operator's surface: client auth, CORS, the access log, tracing.

Part of :class:`~cortex.gateway.config.gateway.GatewayConfig` (sections ``auth``, ``cors``,
``access_log``, ``tracing``); kept apart from the routing settings because they change for
other reasons (an operator's environment, not the cluster's shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cortex.gateway.config.serving import non_negative, positive
from cortex.gateway.errors import ConfigError
from cortex.gateway.http.auth import ApiKeys, KeyDigest, parse_key_lines

__all__ = ["AccessLogConfig", "AuthConfig", "CorsConfig", "TracingConfig"]

_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Inference API keys (``Authorization: Bearer <key>``); none configured = open.

    ``keys``: ``{id, hash}`` entries, ``hash`` = ``sha256:<hex>`` of the key (``cortex
    gateway hash-key`` prints it); in an environment variable, ``id=sha256:<hex>`` items
    separated by commas. ``keys_file``: more of them, one ``<id> sha256:<hex>`` per line,
    read at start. Every path but ``/health*``, ``/metrics`` and ``/admin/*`` (which has its
    own token) needs a key when any is configured.
    """

    keys: tuple[KeyDigest, ...] = ()
    keys_file: Path | None = None

    def __post_init__(self) -> None:
        if self.keys_file is not None and not Path(self.keys_file).is_file():
            raise ConfigError(f"auth.keys_file: {self.keys_file} is not a file")

    def load(self) -> ApiKeys:
        """The accepted keys (reads ``keys_file``); :class:`ConfigError` if it is bad."""
        keys = list(self.keys)
        if self.keys_file is not None:
            try:
                text = Path(self.keys_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"auth.keys_file: cannot read {self.keys_file}: {exc}"
                                  ) from None
            keys += parse_key_lines(text, f"auth.keys_file {self.keys_file}")
        return ApiKeys(keys)


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Cross-origin requests from browsers; off while ``allow_origins`` is empty.

    ``allow_origins``: exact origins (``https://app.example.com``) or ``*``. A preflight
    (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin is answered
    204 with ``allow_methods``/``allow_headers`` and ``max_age_s``; responses to allowed
    origins carry ``Access-Control-Allow-Origin`` and ``expose_headers``.
    ``allow_credentials``: send ``Access-Control-Allow-Credentials: true`` (not with ``*``).
    """

    allow_origins: tuple[str, ...] = ()
    allow_methods: tuple[str, ...] = ("GET", "POST", "OPTIONS")
    allow_headers: tuple[str, ...] = ("authorization", "content-type", "x-request-id",
                                      "traceparent", "tracestate", "openai-organization",
                                      "openai-project", "x-stainless-*")
    expose_headers: tuple[str, ...] = ("x-request-id", "x-cortex-cache-hit-tokens",
                                       "x-cortex-assigned-worker", "x-cortex-match-mode")
    allow_credentials: bool = False
    max_age_s: int = 600

    def __post_init__(self) -> None:
        for origin in self.allow_origins:
            if origin == "*":
                continue
            parts = urlsplit(origin)
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
                raise ConfigError(f"cors.allow_origins: {origin!r} is not an origin "
                                  "(scheme://host[:port]) or *")
        if self.allow_credentials and "*" in self.allow_origins:
            raise ConfigError("cors.allow_credentials: browsers refuse credentials with *")
        non_negative("cors", max_age_s=self.max_age_s)

    @property
    def enabled(self) -> bool:
        return bool(self.allow_origins)


@dataclass(frozen=True, slots=True)
class AccessLogConfig:
    """One log line per answered HTTP request (logger ``cortex.gateway.access``): method,
    path, status, latency (ms), model, worker, match mode, request id, key id.

    ``level``: the level the lines are logged at (below the process's ``--log-level``
    they are dropped). ``skip_paths``: answered without a line (probes, scrapes).
    """

    enabled: bool = True
    level: str = "info"
    skip_paths: tuple[str, ...] = ("/health", "/health/live", "/health/ready", "/metrics")

    def __post_init__(self) -> None:
        if self.level not in _LEVELS:
            raise ConfigError(f"access_log.level: must be one of {', '.join(_LEVELS)}, got "
                              f"{self.level!r}")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces over OTLP/HTTP (protobuf); off by default.

    ``endpoint``: the collector's traces URL (``…:4318/v1/traces``). ``sample_ratio``: the
    share of requests without a sampled ``traceparent`` that are traced (a client's sampled
    ``traceparent`` is always honoured). Spans are batched: at most ``batch_size`` per
    export, every ``export_interval_s``; at most ``max_queue`` wait (more are dropped and
    lost). ``service_name``: the ``service.name`` resource attribute. Spans: the request
    (``POST /v1/chat/completions``; its parent: a client's ``traceparent``), ``parse``,
    ``tokenize``, ``hash``, ``match``, ``score`` and ``upstream`` (until the first byte; its
    context is the ``traceparent`` the worker receives).
    """

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4318/v1/traces"
    service_name: str = "cortex-gateway"
    sample_ratio: float = 1.0
    export_interval_s: float = 1.0
    export_timeout_s: float = 5.0
    batch_size: int = 512
    max_queue: int = 8192

    def __post_init__(self) -> None:
        parts = urlsplit(self.endpoint)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(f"tracing.endpoint: {self.endpoint!r} is not an http(s) URL")
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ConfigError(f"tracing.sample_ratio: must be in [0, 1], got "
                              f"{self.sample_ratio!r}")
        positive("tracing", export_interval_s=self.export_interval_s,
                 export_timeout_s=self.export_timeout_s, batch_size=self.batch_size,
                 max_queue=self.max_queue)
