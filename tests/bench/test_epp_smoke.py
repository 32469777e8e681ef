"""``cortex bench epp`` for a few picks end to end: it runs and writes its report."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_few_picks_are_timed_and_reported(tmp_path: Path) -> None:
    out = tmp_path / "epp.md"
    proc = subprocess.run(
        [sys.executable, "-m", "cortex.edge.main", "bench", "epp", "--picks", "10",
         "--prompt-tokens", "300", "--workers", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=140, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    for row in ("`Router.route` alone", "pick, `BUFFERED`", "pick, `FULL_DUPLEX_STREAMED`",
                "the same from a grpclib client"):
        assert f"| {row}" in text
    assert text.count(" ms |") == 16
