"""``cortex bench soak`` for a few seconds end to end, and its slope (pure)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cortex.bench.soak import SERVICES, slope_mb_per_10min


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.timeout(150)
def test_a_short_soak_samples_every_service_and_reports(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "bench", "soak", "--minutes", "0.2",
         "--warmup", "0.05", "--sample", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "soak.json").read_text())
    assert report["requests"] > 0 and report["failed"] == 0
    for service in SERVICES:
        series = report["samples"][service]
        assert len(series) >= 4 and all(mb > 1 for _, mb in series)
        assert report["services"][service]["slope_mb_per_10min"] is not None
    text = (tmp_path / "soak.md").read_text()
    assert all(f"| {service} |" in text for service in SERVICES)
    assert (tmp_path / "soak.png").stat().st_size > 1000


def test_the_slope_is_in_mb_per_10_minutes() -> None:
    growing = [(t, 100 + t / 60) for t in range(0, 600, 10)]  # 1 MB per minute
    assert slope_mb_per_10min(growing) == pytest.approx(10.0)
    assert slope_mb_per_10min([(0, 5.0), (10, 5.0), (20, 5.0)]) == pytest.approx(0.0)
    assert slope_mb_per_10min([(0, 5.0), (10, 6.0)]) is None  # too few samples
