"""``Profile``: py-spy sampling one process while a benchmark loads it, and its top frames.

``with Profile(pid, path) as p: ...`` records ``pid`` as every benchmark does
(:data:`~cortex.bench.pyspy.SAMPLE_FLAGS`: never pausing it, the thread holding the GIL)
into ``path`` as collapsed stacks; afterwards ``p.top(n)`` is the ``n`` functions with the
most samples on top of the stack (self) and each one's share of all samples including callees
(total). Frames are named ``function (module)``: line numbers are dropped so that one
function is one row.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from cortex.bench.pyspy import SAMPLE_FLAGS

__all__ = ["Frame", "Profile", "frames_table"]


@dataclass(frozen=True)
class Frame:
    """One function's share of the samples, in percent: on top of the stack, and anywhere."""

    name: str
    self_pct: float
    total_pct: float


class Profile:
    """py-spy ``record`` of ``pid`` for the life of the ``with`` block (``rate`` samples/s)."""

    def __init__(self, pid: int, path: Path, rate: int = 200) -> None:
        self.pid = pid
        self.path = path
        self.rate = rate
        self._child: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Profile:
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self._child = subprocess.Popen(
            [spy, "record", "--pid", str(self.pid), "--rate", str(self.rate), "--format", "raw",
             *SAMPLE_FLAGS, "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        assert self._child is not None
        self._child.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        try:
            _, err = self._child.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self._child.kill()
            _, err = self._child.communicate()
        if not self.path.exists():
            raise RuntimeError(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")

    def top(self, n: int = 15) -> tuple[list[Frame], int]:
        """The ``n`` functions with the most self samples, and the number of samples."""
        own: Counter[str] = Counter()
        anywhere: Counter[str] = Counter()
        samples = 0
        for line in self.path.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                count = int(count_text)
                frames = [_name(f) for f in stack.split(";") if not f.startswith("process ")
                          and not f.startswith("thread ")]
                if not frames:
                    continue
                samples += count
                own[frames[-1]] += count
                for name in set(frames):
                    anywhere[name] += count
        scale = 100 / max(samples, 1)
        return [Frame(name, c * scale, anywhere[name] * scale)
                for name, c in own.most_common(n)], samples


def _name(frame: str) -> str:
    """``handle (cortex/gateway/api/inference.py:120)`` -> ``handle (gateway/api/inference)``."""
    function, _, where = frame.partition(" (")
    path = where.rstrip(")").rpartition(":")[0] or where.rstrip(")")
    if not Path(path).name:
        return function
    parts = Path(path).with_suffix("").parts
    for anchor in ("site-packages", "cortex", "lib"):
        if anchor in parts:
            parts = parts[len(parts) - parts[::-1].index(anchor):]
            break
    return f"{function} ({'/'.join(parts[-3:])})"


def frames_table(frames: list[Frame]) -> list[tuple[str, str, str]]:
    """Rows for :func:`cortex.bench.report.table`: function, self %, total %."""
    return [(f"`{f.name}`", f"{f.self_pct:.1f}", f"{f.total_pct:.1f}") for f in frames]
