"""The gateway's one configuration object: frozen, validated on creation, built at the edge.

Sources, later wins: built-in defaults → a TOML or JSON file → environment variables →
the few flags of ``cortex gateway``, all through :mod:`cortex.edge.settings`. Every scalar
is settable as ``CORTEX_GATEWAY_<PATH>`` (e.g. ``CORTEX_GATEWAY_SERVER_PORT=8080``,
``CORTEX_GATEWAY_ROUTING_WEIGHTS_ALPHA=1.5`` — ``CORTEX_GATEWAY_ROUTING_ALPHA`` is its
deprecated alias —, ``CORTEX_GATEWAY_INDEX_TARGETS=10.0.0.5:50051,10.0.0.6:50051``); the
model and worker lists come from the file, or as JSON in ``CORTEX_GATEWAY_MODELS`` /
``CORTEX_GATEWAY_WORKERS``.
Only :func:`load_config` reads the environment. Unknown keys are errors (typos must not pass
silently); every error names the offending key. The sections themselves live in
:mod:`cortex.gateway.config.serving` and :mod:`cortex.gateway.config.middleware`;
import them from here.
"""

from __future__ import annotations

import argparse
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cortex.edge.convert import build
from cortex.edge.settings import SettingsError, SettingsSpec
from cortex.gateway.config.middleware import AccessLogConfig, AuthConfig, CorsConfig, TracingConfig
from cortex.gateway.config.serving import (
    AdmissionConfig,
    BreakerConfig,
    DiscoveryConfig,
    HealthConfig,
    IndexConfig,
    LoadConfig,
    ModelConfig,
    PDConfig,
    RegistryConfig,
    RoutingConfig,
    RoutingWeights,
    ServerConfig,
    SessionConfig,
    Timeouts,
    TokenizeConfig,
    UpstreamConfig,
)
from cortex.gateway.errors import ConfigError
from cortex.registry.spec import WorkerSpec

__all__ = [
    "SETTINGS",
    "AccessLogConfig",
    "AdmissionConfig",
    "AuthConfig",
    "BreakerConfig",
    "CorsConfig",
    "DiscoveryConfig",
    "GatewayConfig",
    "HealthConfig",
    "IndexConfig",
    "LoadConfig",
    "ModelConfig",
    "PDConfig",
    "RegistryConfig",
    "RoutingConfig",
    "RoutingWeights",
    "ServerConfig",
    "SessionConfig",
    "Timeouts",
    "TokenizeConfig",
    "TracingConfig",
    "UpstreamConfig",
    "load_config",
]

ENV_PREFIX = "CORTEX_GATEWAY_"


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """Everything the gateway needs, validated. Build it with :func:`load_config` or
    :meth:`from_mapping`; pass it down, never re-read the environment."""

    models: tuple[ModelConfig, ...]
    server: ServerConfig = field(default_factory=ServerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    registry: RegistryConfig = field(default_factory=RegistryConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    upstream: UpstreamConfig = field(default_factory=UpstreamConfig)
    pd: PDConfig = field(default_factory=PDConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    workers: tuple[WorkerSpec, ...] = ()
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    discovery: DiscoveryConfig = field(default_factory=DiscoveryConfig)
    gateway_id: str = "gateway"
    auth: AuthConfig = field(default_factory=AuthConfig)
    cors: CorsConfig = field(default_factory=CorsConfig)
    access_log: AccessLogConfig = field(default_factory=AccessLogConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    by_name: Mapping[str, ModelConfig] = field(init=False, repr=False, compare=False)
    """The served models by name (read on every request: a lookup, not a search)."""

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models: at least one served model is required")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"models: duplicate model names in {names}")
        object.__setattr__(self, "by_name", types.MappingProxyType(
            {m.name: m for m in self.models}))
        adapters = [a for m in self.models for a in m.adapters]
        if len(set(adapters)) != len(adapters) or set(adapters) & set(names):
            raise ConfigError("models[].adapters: an adapter name is given twice or names a "
                              "model")
        ids = [w.id for w in self.workers]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"workers: duplicate worker ids in {ids}")
        if self.server.read_timeout_s <= self.upstream.request_timeout_s:
            raise ConfigError("server.read_timeout_s: must exceed upstream.request_timeout_s "
                              f"({self.upstream.request_timeout_s:g}), or streams get cut")
        if 0 < self.load.poll_interval_s >= self.routing.load_stale_after_s:
            raise ConfigError("load.poll_interval_s: must be under routing.load_stale_after_s "
                              f"({self.routing.load_stale_after_s:g}), or every engine's load "
                              "counts as missing before the next poll")

    def model(self, name: str) -> ModelConfig | None:
        return self.by_name.get(name)

    def adapter_base(self, name: str) -> ModelConfig | None:
        """The model a configured LoRA adapter ``name`` belongs to."""
        return next((m for m in self.models if name in m.adapters), None)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> GatewayConfig:
        """Build from a decoded file (TOML/JSON layout); raises :class:`ConfigError`."""
        try:
            config: GatewayConfig = build(cls, data, converters=SETTINGS.converters)
        except SettingsError as exc:
            raise ConfigError(str(exc)) from None
        return config


def _worker(value: object) -> WorkerSpec:
    if isinstance(value, WorkerSpec):
        return value
    if not isinstance(value, Mapping):
        raise ValueError("must be a table/object")
    return WorkerSpec.from_dict(value)  # SpecError is a ValueError


_WEIGHTS = ("alpha", "beta", "gamma", "delta", "host_hit", "disk_hit")

FLAGS: dict[str, tuple[str, ...]] = {
    "server.host": ("--host",), "server.port": ("--port",),
    "admission.max_concurrent_requests": ("--max-concurrent-requests",),
    "admission.queue_size": ("--queue-size",),
    "admission.queue_timeout_s": ("--queue-timeout-secs",),
}
"""The settings ``cortex gateway`` takes as flags, with their short (sglang-router's)
spellings; the rest come from the file or the environment (the gateway has over a hundred)."""

SETTINGS = SettingsSpec(
    GatewayConfig, "gateway",
    # the scoring weights' shorter names (docs/configuration.md), deprecated
    aliases={f"{ENV_PREFIX}ROUTING_{w.upper()}": f"routing.weights.{w}" for w in _WEIGHTS},
    flag_names=FLAGS,
    converters={WorkerSpec: _worker},
)
"""The gateway's settings: file, ``CORTEX_GATEWAY_*``, and the few flags of :data:`FLAGS`."""


def load_config(path: Path | str | None, env: Mapping[str, str], *,
                args: argparse.Namespace | None = None) -> GatewayConfig:
    """Read ``path`` (``.toml`` or ``.json``; ``None`` = ``args.config``, else
    ``$CORTEX_GATEWAY_CONFIG``, else nothing), apply ``CORTEX_GATEWAY_*`` overrides from
    ``env``, then the flags in ``args``, validate."""
    try:
        data = SETTINGS.collect(args, env, path)
        if "models" not in data:
            raise ConfigError("models: at least one served model is required")
        config: GatewayConfig = SETTINGS.build(data)
    except SettingsError as exc:
        raise ConfigError(str(exc)) from None
    return config
