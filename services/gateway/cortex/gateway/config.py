"""The gateway's one configuration object: frozen, validated on creation, built at the edge.

Sources, later wins: built-in defaults → a TOML or JSON file → environment variables.
Every scalar of a section is settable as ``CORTEX_GATEWAY_<SECTION>_<FIELD>`` (e.g.
``CORTEX_GATEWAY_SERVER_PORT=8080``, ``CORTEX_GATEWAY_ROUTING_ALPHA=1.5``,
``CORTEX_GATEWAY_INDEX_TARGETS=10.0.0.5:50051,10.0.0.6:50051``); the model and worker
lists come from the file, or as JSON in ``CORTEX_GATEWAY_MODELS`` / ``CORTEX_GATEWAY_WORKERS``.
Only :func:`load_config` reads the environment. Unknown keys are errors (typos must not pass
silently); every error names the offending key. The sections themselves live in
:mod:`cortex.gateway.servingconfig` and :mod:`cortex.gateway.edgeconfig`; import them from here.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from cortex.gateway.auth import KeyDigest
from cortex.gateway.edgeconfig import AccessLogConfig, AuthConfig, CorsConfig, TracingConfig
from cortex.gateway.errors import ConfigError
from cortex.gateway.servingconfig import (
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
    Timeouts,
    TokenizeConfig,
    UpstreamConfig,
)
from cortex.hashing import Engine
from cortex.registry.errors import SpecError
from cortex.registry.spec import WorkerSpec

__all__ = [
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

    def __post_init__(self) -> None:
        if not self.models:
            raise ConfigError("models: at least one served model is required")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError(f"models: duplicate model names in {names}")
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

    def model(self, name: str) -> ModelConfig | None:
        return next((m for m in self.models if m.name == name), None)

    def adapter_base(self, name: str) -> ModelConfig | None:
        """The model a configured LoRA adapter ``name`` belongs to."""
        return next((m for m in self.models if name in m.adapters), None)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> GatewayConfig:
        """Build from a decoded file (TOML/JSON layout); raises :class:`ConfigError`."""
        config: GatewayConfig = _build(cls, data, "")
        return config


# ---- building dataclasses from plain data, with key-naming errors ----


def _convert(value: Any, hint: Any, where: str) -> Any:
    origin = get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _convert(value, options[0], where)
    if hint is WorkerSpec:
        try:
            return value if isinstance(value, WorkerSpec) else WorkerSpec.from_dict(value)
        except SpecError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if hint is KeyDigest and isinstance(value, str):  # id=sha256:<hex>, from the environment
        key_id, _, digest = value.partition("=")
        return KeyDigest(key_id.strip(), digest.strip())
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: must be a table/object")
        return _build(hint, value, where)
    if origin is tuple:
        item = get_args(hint)[0]
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: must be a list")
        return tuple(_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    if origin in (Mapping, dict) or hint is Mapping:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: must be a table/object")
        value_hint = get_args(hint)[1]
        return {str(k): _convert(v, value_hint, f"{where}.{k}") for k, v in value.items()}
    if hint is bool:
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false",
                                                         "no", "off"):
            return value.lower() in ("1", "true", "yes", "on")
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: must be true or false, got {value!r}")
        return value
    if hint is int or hint is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: must be a number, got {value!r}")
        try:
            number = hint(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: must be a number, got {value!r}") from None
        if hint is int and isinstance(value, float) and number != value:
            raise ConfigError(f"{where}: must be an integer, got {value!r}")
        return number
    if hint is str or hint is Path or hint is Engine:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: must be a string, got {value!r}")
        try:
            return hint(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    return value


def _build(cls: type[Any], data: Mapping[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown key(s) {', '.join(unknown)}")
    kwargs = {}
    for name, value in data.items():
        key = f"{where}.{name}" if where else name
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from None


_SECTIONS = ("server", "routing", "index", "registry", "health", "breaker", "load", "upstream",
             "pd", "tokenize", "admission", "discovery", "auth", "cors", "access_log",
             "tracing")


def _env_overrides(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for var, text in env.items():
        if not var.startswith(ENV_PREFIX) or var == ENV_PREFIX + "CONFIG":
            continue
        rest = var[len(ENV_PREFIX):].lower()
        if rest in ("models", "workers"):
            try:
                raw[rest] = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"{var}: not valid JSON: {exc}") from None
            continue
        if rest == "gateway_id":
            raw["gateway_id"] = text
            continue
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), "")
        name = rest[len(section) + 1:]
        if not section or not name:
            raise ConfigError(f"{var}: unknown setting")
        table = raw.setdefault(section, {})
        if section == "routing" and name in ("alpha", "beta", "gamma", "delta", "host_hit",
                                             "disk_hit"):
            table = table.setdefault("weights", {})
        table[name] = text


def load_config(path: Path | str | None, env: Mapping[str, str]) -> GatewayConfig:
    """Read ``path`` (``.toml`` or ``.json``; ``None`` = ``$CORTEX_GATEWAY_CONFIG`` or
    nothing), apply ``CORTEX_GATEWAY_*`` overrides from ``env``, validate."""
    if path is None:
        path = env.get(ENV_PREFIX + "CONFIG") or None
    raw: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        try:
            text = file.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file}: {exc.strerror}") from None
        try:
            raw = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{file}: {exc}") from None
    _env_overrides(raw, env)
    if "models" not in raw:
        raise ConfigError("models: at least one served model is required")
    return GatewayConfig.from_mapping(raw)
