"""`cortex bench transport` runs end to end and writes its report (a smoke test, not a
timing): every stream shape at both ends, over both transports."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.bench import transport

pytestmark = pytest.mark.timeout(60)


def test_bench_transport_writes_every_cell(tmp_path: Path) -> None:
    assert transport.main(["--out", str(tmp_path), "--messages", "50", "--rounds", "1"]) == 0
    report = (tmp_path / "transport.md").read_text()
    rows = [line.split(" | ") for line in report.splitlines() if line.startswith("| ")][1:]
    assert [(r[0].removeprefix("| "), r[1].split(" ")[0]) for r in rows] == [
        ("Sync", "client"), ("Sync", "server"), ("Replicate", "client"),
        ("Replicate", "server")]
    assert all(float(r[2]) >= 0 and float(r[3]) >= 0 for r in rows)
    assert float(rows[0][2]) > 0 and float(rows[0][3]) > 0  # the client's own CPU, in µs
