"""``cortex.bench.pyspy``: top frames of py-spy's raw output (no process sampled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.bench.pyspy import top_frames, top_frames_table


def test_top_frames_share_samples_and_leave_out_the_event_loop(tmp_path: Path) -> None:
    raw = tmp_path / "index.txt"
    raw.write_text(
        "<module> (x.py:1);_run_once (asyncio/base_events.py:9);apply (index/core.py:3);"
        "store (ledger/native.py:99) 3\n"
        "<module> (x.py:1);_run_once (asyncio/base_events.py:9);apply (index/core.py:4) 1\n"
        "<module> (x.py:1);_run_once (asyncio/base_events.py:9);"
        "write (asyncio/selector_events.py:1057) 4\n")
    total, rows = top_frames(raw)
    assert total == 8
    shares = {name: (inc, own) for name, inc, own in rows}
    assert shares["write (asyncio/selector_events.py)"] == pytest.approx((50.0, 50.0))
    assert shares["apply (index/core.py)"] == pytest.approx((50.0, 12.5))
    assert shares["store (ledger/native.py)"] == pytest.approx((37.5, 37.5))
    assert not any("base_events" in name or "<module>" in name for name in shares)
    assert "| `apply (index/core.py)` | 50.0 % | 12.5 % |" in top_frames_table(raw)
