"""A ``cortex sim`` child process, for tests, benchmarks and launchers that need a real one.

``with SimProcess("--engine", "vllm", "--port", "0", "--kv-events-port", "0") as sim:``
starts ``python -m cortex.edge.main sim ...``, waits for its ready line and exposes the
bound ports; leaving the block sends SIGTERM (SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from cortex.sim.cli import READY_PREFIX

__all__ = ["SimProcess", "SimProcessError", "started_sims"]


class SimProcessError(RuntimeError):
    """The sim process exited or never became ready; the message has its log tail."""


class SimProcess:
    """One ``cortex sim`` process; ``info`` is its ready line (url, ports, engine, role)."""

    def __init__(self, *args: str, startup_timeout_s: float = 30.0,
                 env: dict[str, str] | None = None) -> None:
        self.argv = [sys.executable, "-m", "cortex.edge.main", "sim", *args]
        self.startup_timeout_s = startup_timeout_s
        self._env = env
        self._log = tempfile.NamedTemporaryFile(prefix="cortex-sim-", suffix=".log",
                                                delete=False)
        self.log_path = Path(self._log.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> SimProcess:
        """Launch and wait until ready (``SimProcessError`` with the log tail otherwise)."""
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> None:
        """Start the process without waiting (start several, then :meth:`wait_ready` each)."""
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self._log,
                                     stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(self._env or {})})

    def wait_ready(self) -> dict[str, Any]:
        """Wait for the ready line; stops the process and raises on failure."""
        try:
            self.info = self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self.info

    def _wait_ready(self) -> dict[str, Any]:
        if self.proc is None or self.proc.stdout is None:
            raise SimProcessError("the sim process was not launched")
        deadline = time.monotonic() + self.startup_timeout_s
        buffer = b""
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SimProcessError(f"sim not ready after {self.startup_timeout_s}s:\n"
                                          f"{self.log_tail()}")
                if sel.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(self.proc.stdout.fileno(), 65536)
                    if not chunk:
                        self.proc.wait(timeout=5)
                        raise SimProcessError(f"sim exited with {self.proc.returncode}:\n"
                                              f"{self.log_tail()}")
                    buffer += chunk
                    for line in buffer.decode(errors="replace").splitlines():
                        if line.startswith(READY_PREFIX):
                            info: dict[str, Any] = json.loads(line[len(READY_PREFIX):])
                            return info

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if proc.stdout is not None:
            proc.stdout.close()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL at once (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def __enter__(self) -> SimProcess:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop the process (if launched) and delete its log file."""
        self.stop()
        self._log.close()
        self.log_path.unlink(missing_ok=True)

    # -- what it bound --------------------------------------------------------------------

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @property
    def port(self) -> int:
        return int(self.info["port"])

    @property
    def kv_events_endpoint(self) -> str:
        host = self.url.split("//", 1)[1].rsplit(":", 1)[0]
        return f"tcp://{host}:{self.info['kv_events_port']}"

    @property
    def replay_endpoint(self) -> str | None:
        if self.info.get("replay_port") is None:
            return None
        host = self.url.split("//", 1)[1].rsplit(":", 1)[0]
        return f"tcp://{host}:{self.info['replay_port']}"

    @property
    def bootstrap_port(self) -> int | None:
        value = self.info.get("bootstrap_port")
        return None if value is None else int(value)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, limit: int = 4000) -> str:
        self._log.flush()
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"SimProcess({self.info.get('url', '?')}, {state})"


@contextlib.contextmanager
def started_sims(*argvs: tuple[str, ...]) -> Iterator[list[SimProcess]]:
    """One sim per argument list, launched together and each waited for; all stopped on
    exit (also when one fails to start)."""
    with contextlib.ExitStack() as stack:
        procs = [SimProcess(*argv) for argv in argvs]
        for proc in procs:
            stack.callback(proc.close)
            proc.launch()
        for proc in procs:
            proc.wait_ready()
        yield procs
