"""``cortex bench hashing`` runs end to end (a smoke run: no timing is asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cortex.bench import hashing
from cortex.edge.main import main


def test_every_case_computes_what_it_names() -> None:
    cases = hashing.build_cases()
    assert {case.group for case in cases} == {"cortex", "engine"}
    for case in cases:
        result = case.fn()
        assert isinstance(result, (bytes, list))
        if case.block_size and isinstance(result, list):
            assert len(result) == case.tokens // case.block_size


def test_the_bench_writes_its_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "hashing", "--out", str(tmp_path / "bench"), "--seconds", "0.001"])
    report = tmp_path / "bench" / "hashing.md"
    assert code == 0
    assert capsys.readouterr().out.strip() == str(report)
    text = report.read_text(encoding="utf-8")
    assert text.startswith("# Hashing benchmark")
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(hashing.build_cases())


def test_non_positive_seconds_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert hashing.main(["--seconds", "0"]) == 2
    assert "positive" in capsys.readouterr().err
