"""Process and port helpers shared by the test suite, the dev-cluster launcher and benchmarks.

Nothing here sleeps for a fixed time: every wait polls a condition until a deadline.
"""

from cortex.testing.metrics import metric_sum
from cortex.testing.peers import peer_program, sglang_router_argv, vllm_router_argv
from cortex.testing.procs import (
    RedisServer,
    die_with,
    free_port,
    serve_app,
    wait_until,
    wait_until_async,
)

__all__ = [
    "RedisServer",
    "die_with",
    "free_port",
    "metric_sum",
    "peer_program",
    "serve_app",
    "sglang_router_argv",
    "vllm_router_argv",
    "wait_until",
    "wait_until_async",
]
