"""The Cortex gateway: OpenAI-compatible HTTP entry point with KV-cache-aware routing.

``async with GatewayServer(config) as gw:`` runs one on hypercorn in the current event loop;
``cortex gateway`` runs it as a process. See ``docs/gateway.md``.
"""

from cortex.gateway.config.gateway import (
    GatewayConfig,
    IndexConfig,
    ModelConfig,
    RegistryConfig,
    RoutingConfig,
    RoutingWeights,
    ServerConfig,
    load_config,
)
from cortex.gateway.errors import ClientError, ConfigError, GatewayError, ServiceUnavailable
from cortex.gateway.server import GatewayServer

__all__ = [
    "ClientError",
    "ConfigError",
    "GatewayConfig",
    "GatewayError",
    "GatewayServer",
    "IndexConfig",
    "ModelConfig",
    "RegistryConfig",
    "RoutingConfig",
    "RoutingWeights",
    "ServerConfig",
    "ServiceUnavailable",
    "load_config",
]
