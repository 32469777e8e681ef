"""What a process (or the machine) has spent, read from ``/proc``: the benchmarks' one meter.

CPU is user + system time in seconds; memory is the resident set size. A process that is gone
reads as ``None`` so a benchmark can tell a crash from an idle process.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "busy_cores",
    "cpu_s",
    "machine_busy_s",
    "rss_bytes",
    "rss_mb",
    "session_cpu_s",
    "session_pids",
]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has spent so far (``None`` once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # the command name may hold spaces and ')'
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def busy_cores(start: tuple[float, float], end: tuple[float, float]) -> float:
    """Cores the machine kept busy between two :func:`machine_busy_s` readings."""
    (busy0, total0), (busy1, total1) = start, end
    cores = os.cpu_count() or 1
    return (busy1 - busy0) / (total1 - total0) * cores if total1 > total0 else 0.0


def session_pids(session: int) -> list[int]:
    """The live processes of ``session`` (a session leader's pid: an engine and the workers
    it forked)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[3]) == session:  # field 6 of stat: the session id
            pids.append(int(stat.parent.name))
    return pids


def session_cpu_s(session: int) -> float:
    """User + system CPU seconds spent so far by the live processes of ``session``."""
    return sum(cpu_s(pid) or 0.0 for pid in session_pids(session))


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes (``None`` once it is gone)."""
    try:
        statm = Path(f"/proc/{pid}/statm").read_text()
    except OSError:
        return None
    return int(statm.split()[1]) * _PAGE


def rss_mb(pid: int) -> float | None:
    """Resident set size of ``pid`` in MB (2**20 bytes; ``None`` once it is gone)."""
    rss = rss_bytes(pid)
    return None if rss is None else rss / 2**20


def machine_busy_s() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, over all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user
    return (total - idle) / _CLK_TCK, total / _CLK_TCK
