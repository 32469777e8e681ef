"""The Cortex gateway: OpenAI-compatible HTTP entry point with KV-cache-aware routing.

``async with GatewayServer(config) as gw:`` runs one in the current event loop;
``cortex gateway`` runs it as a process. See ``docs/gateway.md``.

Besides the server and its configuration, the package exports the stages that the
benchmarks drive on their own (the tokenizer service and the lazy walk, the router and the
worker pool, request parsing, the ledger replica, the endpoint picker): other distributions
import the gateway only from here, never from its modules.
"""

from cortex.gateway.config.gateway import (
    BreakerConfig,
    GatewayConfig,
    HealthConfig,
    IndexConfig,
    LoadConfig,
    ModelConfig,
    PDConfig,
    RegistryConfig,
    RoutingConfig,
    RoutingWeights,
    ServerConfig,
    TokenizeConfig,
    load_config,
)
from cortex.gateway.epp.server import PROCESS as EPP_PROCESS
from cortex.gateway.epp.server import EppServer
from cortex.gateway.errors import ClientError, ConfigError, GatewayError, ServiceUnavailable
from cortex.gateway.fleet.pool import EngineLoad, Health, WorkerPool
from cortex.gateway.http.auth import hash_key
from cortex.gateway.ledger.replica_client import ReplicaClient
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, parse_body, parse_request
from cortex.gateway.routing.router import Router
from cortex.gateway.server import GatewayServer
from cortex.gateway.tokens.prompt import BytesPerToken, PromptTokenizer, held_prefix, walk
from cortex.gateway.tokens.service import Tokenization, next_turn

__all__ = [
    "EPP_PROCESS",
    "BreakerConfig",
    "BytesPerToken",
    "ClientError",
    "ConfigError",
    "EngineLoad",
    "EppServer",
    "GatewayConfig",
    "GatewayError",
    "GatewayMetrics",
    "GatewayServer",
    "Health",
    "HealthConfig",
    "IndexConfig",
    "InferencePath",
    "LoadConfig",
    "ModelConfig",
    "PDConfig",
    "PromptTokenizer",
    "RegistryConfig",
    "ReplicaClient",
    "Router",
    "RoutingConfig",
    "RoutingWeights",
    "ServerConfig",
    "ServiceUnavailable",
    "Tokenization",
    "TokenizeConfig",
    "WorkerPool",
    "hash_key",
    "held_prefix",
    "load_config",
    "next_turn",
    "parse_body",
    "parse_request",
    "walk",
]
