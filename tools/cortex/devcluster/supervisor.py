"""Child processes of the dev-cluster launcher: start, watch, and stop them all.

The supervisor owns every child it starts. Children die with the launcher even
when it is killed outright (``PR_SET_PDEATHSIG``), and ``stop_all`` sends
SIGTERM to each child's process group, then SIGKILL after a grace period, so no
orphan survives a crash, Ctrl-C or SIGTERM.

``PR_SET_PDEATHSIG`` fires when the *thread* that started the child exits: start
children from a thread that lives as long as the cluster (normally the main thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from cortex.testing import die_with

__all__ = ["Child", "ChildExited", "Supervisor"]

class ChildExited(RuntimeError):
    """A supervised child exited while the cluster was meant to be running."""


@dataclass
class Child:
    """One supervised process: its name, command line, extra environment and log file.

    ``retired`` is set when the supervisor stopped or killed it on purpose: such an
    exit is not a crash.
    """

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] = field(repr=False)
    env: dict[str, str] = field(default_factory=dict, repr=False)
    retired: bool = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def crashed(self) -> bool:
        """Exited without the supervisor asking it to."""
        return not self.retired and not self.alive()

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

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ if env is None else env)
        self.children: list[Child] = []

    def start(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
              ) -> Child:
        """Start ``argv`` in its own process group, output appended to ``<name>.log``;
        ``env`` is added to the supervisor's environment for this child only."""
        extra = dict(env or {})
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**self.env, **extra},
                preexec_fn=die_with(os.getpid()),
            )
        child = Child(name, list(argv), log_path, proc, extra)
        self.children.append(child)
        return child

    def start_cortex(self, name: str, args: Sequence[str],
                     env: Mapping[str, str] | None = None) -> Child:
        """Start ``cortex ARGS`` with the same interpreter as the launcher."""
        return self.start(name, [sys.executable, "-m", "cortex.edge.main", *args], env)

    def crashed(self) -> list[Child]:
        """Children that exited without being stopped or killed through the supervisor."""
        return [child for child in self.children if child.crashed()]

    def check(self) -> None:
        """Raise :class:`ChildExited` for the first child that crashed."""
        for child in self.crashed():
            raise ChildExited(
                f"{child.name} exited with code {child.proc.returncode}; "
                f"last log lines ({child.log_path}):\n{child.log_tail()}"
            )

    def signal(self, child: Child, sig: signal.Signals) -> None:
        """Send ``sig`` to the child's process group (no-op once it exited)."""
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, sig)

    def kill(self, child: Child) -> None:
        """SIGKILL the child's process group at once (a crash on purpose) and reap it."""
        child.retired = True
        self.signal(child, signal.SIGKILL)
        child.proc.wait()

    def stop(self, child: Child, grace: float = 5.0) -> None:
        """SIGTERM the child's process group, SIGKILL after ``grace`` seconds; reap it."""
        child.retired = True
        self.signal(child, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while child.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.signal(child, signal.SIGKILL)
        child.proc.wait()

    def restart(self, child: Child, grace: float = 5.0) -> Child:
        """Stop ``child`` and start the same command again (same log, same place in the
        stop order); returns the new child."""
        self.stop(child, grace)
        new = self.start(child.name, child.argv, child.env)
        self.children.remove(new)
        self.children[self.children.index(child)] = new
        return new

    def stop_all(self, grace: float = 5.0) -> None:
        """Stop children in reverse start order (clients before the servers they use):
        SIGTERM to all at once, SIGKILL to what is left after ``grace`` seconds."""
        for child in reversed(self.children):
            child.retired = True
            self.signal(child, signal.SIGTERM)
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
