"""`cortex bench wire` runs end to end and writes its report (a smoke test, not a timing)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from cortex.bench import wire

pytestmark = pytest.mark.timeout(60)


def test_bench_wire_writes_a_full_report(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    sub: argparse._SubParsersAction[Any] = parser.add_subparsers()
    wire.register(sub)
    args = parser.parse_args(["wire", "--out", str(tmp_path), "--seconds", "0.001"])
    assert args.func(args) == 0
    report = (tmp_path / "wire.md").read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ")][1:]  # no header
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == [
        r.message for r in wire.build_rows()]
    assert all(row.split(" | ")[3] != "-" for row in rows)  # every message was decoded


def test_bench_wire_rejects_a_bad_duration(tmp_path: Path) -> None:
    assert wire.main(["--out", str(tmp_path), "--seconds", "0"]) == 2
    assert not (tmp_path / "wire.md").exists()
