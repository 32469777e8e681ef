"""``cortex bench core`` on a small ledger end to end: both cores measured, one report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(150)
def test_a_small_core_comparison_measures_both_cores_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "core.md"
    proc = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "bench", "core", "--blocks", "20000",
         "--queries", "300", "--big", "30000", "--churn", "20", "--out", str(out)],
        capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for row in ("tree apply", "index CPU per block", "replica CPU per block", "Match, 256 keys",
                "one tree's RSS growth per block", "replica CPU per update, steady state",
                "same, op by op"):
        assert f"| {row}" in text, row
    assert "core native" in proc.stdout and "core python" in proc.stdout
