"""``cortex.sim``: a simulated SGLang / vLLM worker, indistinguishable at the protocol level.

In-process use (tests, benchmarks, the dev launcher)::

    async with SimServer(SimConfig(engine=Engine.VLLM, port=0, kv_events_port=0)) as sim:
        sim.url, sim.kv_events_endpoint, sim.replay_endpoint, sim.engine.cache

The submodules are imported lazily: ``import cortex.sim`` alone costs nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cortex.sim.config import FaultConfig, Role, SimConfig, TimingConfig
    from cortex.sim.server import SimServer

__all__ = ["FaultConfig", "Role", "SimConfig", "SimServer", "TimingConfig"]


def __getattr__(name: str) -> Any:
    if name == "SimServer":
        from cortex.sim.server import SimServer

        return SimServer
    if name in ("FaultConfig", "Role", "SimConfig", "TimingConfig"):
        from cortex.sim import config

        return getattr(config, name)
    raise AttributeError(name)
