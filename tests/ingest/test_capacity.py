"""The ledger bound made of a worker's reported KV capacity (pure)."""

from __future__ import annotations

from cortex.ingest.capacity import block_bound


def test_the_bound_adds_the_margin_and_the_configured_tiers() -> None:
    assert block_bound(8192, 0.25, 0) == 10240
    assert block_bound(8192, 0.25, 100_000) == 110240
    assert block_bound(None, 0.25, 100_000) == 0  # unknown: no bound
