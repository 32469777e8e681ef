"""The benchmarks' markdown table: shape, alignment, and refusing shifted columns."""

import pytest

from cortex.bench.report import table


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
