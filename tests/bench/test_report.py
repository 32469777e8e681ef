"""The benchmarks' report pieces: the markdown table (shape, alignment, refusing shifted
columns) and publishing a report."""

from pathlib import Path

import pytest

from cortex.bench.report import publish, table


def test_table_has_header_rule_and_rows() -> None:
    lines = table(("what", "µs", "note"), [("match", 1.5, ""), ("sync", 12, "batched")], "lr")

    assert lines == [
        "| what | µs | note |",
        "|---|---:|---|",
        "| match | 1.5 |  |",
        "| sync | 12 | batched |",
    ]


def test_table_without_rows_is_header_and_rule() -> None:
    assert table(("a", "b"), []) == ["| a | b |", "|---|---|"]


@pytest.mark.parametrize("row", [("only one",), ("one", "two", "three")])
def test_a_row_of_the_wrong_width_is_refused(row: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="cells in a table of 2 columns"):
        table(("a", "b"), [row])


@pytest.mark.parametrize("align", ["lrr", "c"])
def test_alignment_must_fit_the_columns(align: str) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        table(("a", "b"), [], align)


def test_a_published_report_lands_in_its_new_folder_and_on_stdout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "docs" / "bench" / "x.md"
    publish("# X\n\n| a |\n", out)
    assert out.read_text(encoding="utf-8") == "# X\n\n| a |\n"
    printed = capsys.readouterr()
    assert printed.out == "# X\n\n| a |\n\n"
    assert printed.err == f"report written to {out}\n"
