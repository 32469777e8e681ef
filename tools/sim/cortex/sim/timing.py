"""The cost model: how long prefill and decode take, in milliseconds (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from cortex.sim.config import TimingConfig

__all__ = ["TimingModel"]


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Durations derived from :class:`TimingConfig`; all zero in zero-cost mode."""

    config: TimingConfig

    @property
    def zero_cost(self) -> bool:
        return self.config.zero_cost

    def prefill_ms(self, uncached_tokens: int, loaded_tokens: int = 0) -> float:
        """Time of a prefill with ``uncached_tokens`` tokens not in the cache and
        ``loaded_tokens`` loaded back from the host tier (ms)."""
        if self.config.zero_cost:
            return 0.0
        cfg = self.config
        return (cfg.prefill_overhead_ms
                + cfg.prefill_ms_per_uncached_token * max(uncached_tokens, 0)
                + cfg.host_load_ms_per_token * max(loaded_tokens, 0))

    def decode_ms(self, tokens: int = 1) -> float:
        """Time to generate ``tokens`` further output tokens (ms)."""
        if self.config.zero_cost:
            return 0.0
        return self.config.decode_ms_per_token * max(tokens, 0)
