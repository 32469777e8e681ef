"""The benchmarks' report pieces: provenance (when, where, with what) and markdown tables."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

__all__ = ["cpu_model", "package_version", "provenance", "publish", "table"]

_RULES = {"l": "---", "r": "---:"}


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], align: str = ""
          ) -> list[str]:
    """A markdown table as lines: the header, the rule, then one line per row.

    Cells are written with ``str``; ``align`` has one letter per column, ``l`` (left, the
    default for columns it does not cover) or ``r`` (right: numbers). A row of the wrong width
    is a ``ValueError``: a report with shifted columns reads as wrong numbers.
    """
    if len(align) > len(columns) or set(align) - set(_RULES):
        raise ValueError(f"align {align!r} does not fit {len(columns)} columns of l/r")
    rules = [_RULES[a] for a in align.ljust(len(columns), "l")]
    lines = [_line(columns), "|" + "|".join(rules) + "|"]
    for row in rows:
        if len(row) != len(columns):
            raise ValueError(f"a row of {len(row)} cells in a table of {len(columns)} columns: "
                             f"{row!r}")
        lines.append(_line(str(cell) for cell in row))
    return lines


def publish(report: str, out: Path) -> None:
    """Write a benchmark's markdown ``report`` to ``out`` (its folder made as needed), print
    it, and say where it went on stderr."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report, encoding="utf-8")
    print(report)
    print(f"report written to {out}", file=sys.stderr)


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def provenance() -> dict[str, str]:
    """When, at which commit and on what a report was made."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5, check=False).stdout.strip()
    except OSError:
        commit = ""
    return {"generated": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit or "unknown",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                       f"Python {platform.python_version()}"}


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def package_version(package: str) -> str:
    """The installed version of a distribution, or ``not installed``."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"
