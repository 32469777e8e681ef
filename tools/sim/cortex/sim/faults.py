"""Fault injection state: what goes wrong next, switchable at run time (pure)."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping
from enum import StrEnum
from typing import Any

from cortex.sim.config import FaultConfig

__all__ = ["BatchFate", "FaultState"]


class BatchFate(StrEnum):
    """What happens to the next event batch on the PUB socket."""

    SEND = "send"
    DROP = "drop"          # never sent live (a seq gap); still in the replay buffer
    DUPLICATE = "duplicate"  # sent twice
    REORDER = "reorder"    # held back and sent after the next batch


class FaultState:
    """The armed faults; counters count down as batches go out.

    ``update`` takes a partial mapping of :class:`FaultConfig` fields and validates the
    result as a whole before changing anything (``ValueError`` / ``TypeError`` otherwise).
    """

    def __init__(self, config: FaultConfig, seed: int = 0) -> None:
        self._config = config
        self._rng = random.Random(seed)

    @property
    def config(self) -> FaultConfig:
        return self._config

    def update(self, patch: Mapping[str, Any]) -> FaultConfig:
        known = {f.name for f in dataclasses.fields(FaultConfig)}
        unknown = set(patch) - known
        if unknown:
            raise ValueError(f"unknown fault fields: {sorted(unknown)}")
        self._config = dataclasses.replace(self._config, **dict(patch))
        return self._config

    def clear(self) -> None:
        self._config = FaultConfig()

    def next_batch_fate(self) -> BatchFate:
        cfg = self._config
        if cfg.drop_batches:
            self._config = dataclasses.replace(cfg, drop_batches=cfg.drop_batches - 1)
            return BatchFate.DROP
        if cfg.duplicate_batches:
            self._config = dataclasses.replace(cfg, duplicate_batches=cfg.duplicate_batches - 1)
            return BatchFate.DUPLICATE
        if cfg.reorder_batches:
            self._config = dataclasses.replace(cfg, reorder_batches=cfg.reorder_batches - 1)
            return BatchFate.REORDER
        return BatchFate.SEND

    def error_status(self) -> int | None:
        """The status to fail this request with, or ``None`` to serve it."""
        rate = self._config.error_rate
        if rate > 0 and self._rng.random() < rate:
            return self._config.error_status
        return None

    def snapshot(self) -> dict[str, Any]:
        return dataclasses.asdict(self._config)

    def __repr__(self) -> str:
        return f"FaultState({self._config})"
