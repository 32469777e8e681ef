"""Reading a Prometheus text page in tests."""

from __future__ import annotations

import re


def metric_sum(metrics: str, name: str, labels: str = "") -> float:
    """Sum of the samples of ``name`` in the text page ``metrics`` whose label set (none:
    empty) contains ``labels``; 0 when there is none."""
    pattern = rf"^{re.escape(name)}(?:\{{([^}}]*)\}})? (\S+)$"
    return sum(float(value) for found, value in re.findall(pattern, metrics, re.MULTILINE)
               if labels in found)
