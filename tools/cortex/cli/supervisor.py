"""Child processes of the dev-cluster launcher: start, watch, and stop them all.

The supervisor owns every child it starts. Children die with the launcher even
when it is killed outright (``PR_SET_PDEATHSIG``), and ``stop_all`` sends
SIGTERM to each child's process group, then SIGKILL after a grace period, so no
orphan survives a crash, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

__all__ = ["Child", "ChildExited", "Supervisor"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class ChildExited(RuntimeError):
    """A supervised child exited while the cluster was meant to be running."""


@dataclass
class Child:
    """One supervised process: its name, command line and log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "running" if self.alive() else f"exited {self.proc.returncode}"
        return f"Child({self.name!r}, pid={self.pid}, {state})"


class Supervisor:
    """Starts children with logs in ``log_dir`` and stops them all on exit."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str]) -> Child:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                preexec_fn=_die_with_parent,
            )
        child = Child(name, list(argv), log_path, proc)
        self.children.append(child)
        return child

    def start_cortex(self, name: str, args: Sequence[str]) -> Child:
        """Start ``cortex ARGS`` with the same interpreter as the launcher."""
        return self.start(name, [sys.executable, "-m", "cortex.cli.main", *args])

    def check(self) -> None:
        """Raise :class:`ChildExited` for the first child that is no longer running."""
        for child in self.children:
            if not child.alive():
                raise ChildExited(
                    f"{child.name} exited with code {child.proc.returncode}; "
                    f"last log lines ({child.log_path}):\n{child.log_tail()}"
                )

    def stop(self, child: Child, grace: float = 5.0) -> None:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
        child.proc.wait()

    def stop_all(self, grace: float = 5.0) -> None:
        """Stop children in reverse start order (clients before the servers they use)."""
        for child in reversed(self.children):
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(c.alive() for c in self.children) and time.monotonic() < deadline:
            time.sleep(0.02)
        for child in self.children:
            self.stop(child, grace=0)

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def __repr__(self) -> str:
        return f"Supervisor({self.children!r})"
