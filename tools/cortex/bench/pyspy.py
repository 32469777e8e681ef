"""py-spy around a benchmark's process: record a window, report its top frames.

The benchmarks that profile a service process (``--profile``) start :func:`record` on its pid
for the measured window and put :func:`top_frames` of the raw output into their report:
where the process's time goes, by function, as the share of samples that had the function
on the stack (inclusive) or on top (self).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

__all__ = ["SAMPLE_FLAGS", "find_py_spy", "record", "top_frames", "top_frames_table"]

SAMPLE_FLAGS = ("--nonblocking", "--gil")
"""How every benchmark samples: never pausing the process (``--nonblocking``: the profile
does not slow what it measures), and only the thread holding the GIL (``--gil``). py-spy's
own idle filter misses threads waiting where it does not look: an event loop on uvloop
waits in ``epoll_pwait``, an idle executor thread in a lock, and both were counted as
running (on a gateway at 3 % CPU, half of all samples were idle threads, a quarter the
loop's wait). What the GIL filter leaves out: native work that releases it (an encoder
running in a thread without the GIL)."""

_FRAME = re.compile(r"(?P<name>.*) \((?P<file>.*?)(?::\d+)?\)$")


def find_py_spy(given: str = "") -> str:
    """The py-spy executable (``given``, or on ``PATH``); SystemExit when there is none."""
    found = given or shutil.which("py-spy")
    if not found:
        raise SystemExit("--profile needs py-spy (pip install py-spy, or --py-spy PATH)")
    return found


def record(py_spy: str, pid: int, seconds: float, out: Path, rate: int = 250
           ) -> subprocess.Popen[bytes]:
    """Start sampling ``pid`` for ``seconds`` into ``out`` (raw collapsed stacks)."""
    return subprocess.Popen(
        [py_spy, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
         "--rate", str(rate), "--format", "raw", "--output", str(out), *SAMPLE_FLAGS],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _name(frame: str) -> str:
    m = _FRAME.match(frame)
    return f"{m['name']} ({m['file']})" if m else frame


def top_frames(raw: Path, n: int = 15) -> tuple[int, list[tuple[str, float, float]]]:
    """``(samples, [(function, inclusive %, self %)])``, the ``n`` largest by inclusive share,
    leaving out the frames every sample has. py-spy samples by wall clock and skips idle
    threads (:data:`SAMPLE_FLAGS`), so a thread preempted while runnable (a busy machine)
    still counts."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        frames = [_name(f) for f in stack.split(";")]
        for name in set(frames):
            inclusive[name] += int(count)
        own[frames[-1]] += int(count)
    rows = [(name, 100 * c / total, 100 * own[name] / total)
            for name, c in inclusive.most_common() if not _scaffolding(name)]
    return total, rows[:n]


def _scaffolding(name: str) -> bool:
    """Frames every sample has (the interpreter's start, the event loop's run): they say
    nothing about where the time goes."""
    return (name.endswith(_LOOP_FILES) or "(<frozen" in name or "<module>" in name
            or name.startswith(("serve (", "_main (", "main (", "run (")))


_LOOP_FILES = ("(asyncio/base_events.py)", "(asyncio/runners.py)", "(asyncio/events.py)")


def top_frames_table(raw: Path, n: int = 15) -> list[str]:
    """Markdown lines: the top frames of ``raw``."""
    total, rows = top_frames(raw, n)
    lines = [f"{total:,} samples; share of samples with the function on the stack / on top:",
             "", "| function | inclusive | self |", "|---|---:|---:|"]
    lines += [f"| `{name}` | {inc:.1f} % | {own:.1f} % |" for name, inc, own in rows]
    return lines
