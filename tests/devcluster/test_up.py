"""``cortex up`` as a user runs it: a child process, its printed curl, its state file, signals.

Each test starts the real launcher (zero-cost sims, free ports, a 3 s lease) and checks that
no process it started survives it — after SIGTERM, Ctrl-C, a crashed child, or the launcher
itself being killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from grpclib.exceptions import GRPCError

from cortex.ledger.client import IndexStub, index_channel
from cortex.ledger.codec import pb
from cortex.sim.process import SimProcess
from cortex.testing import RedisServer, wait_until
from cortex.testing.envoy import INSTALL_HINT as ENVOY_HINT
from cortex.testing.envoy import envoy_binary

pytestmark = pytest.mark.slow

START_TIMEOUT_S = 60.0


def gone(pid: int) -> bool:
    """The process is no more (a zombie left to an init that does not reap counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def pids(state: dict[str, Any]) -> dict[str, int]:
    found = {w["id"]: w["pid"] for w in state["workers"]}
    found.update({g["id"]: g["pid"] for g in state["gateways"]})
    for name in ("redis", "index", "ingest"):
        if state[name] and state[name].get("pid"):
            found[name] = state[name]["pid"]
    return found


@dataclass
class Launcher:
    proc: subprocess.Popen[bytes]
    state_file: Path
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def wait_state(self) -> dict[str, Any]:
        def ready() -> bool:
            assert self.proc.poll() is None, (
                f"cortex up exited {self.proc.returncode}:\n{self.stdout()}\n{self.stderr()}")
            return self.state_file.exists()

        wait_until(ready, timeout=START_TIMEOUT_S, interval=0.05, what="the state file")
        state: dict[str, Any] = json.loads(self.state_file.read_text())
        return state

    def wait_exit(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGTERM if still running; SIGKILL after 30 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Any]:
    launched: list[Launcher] = []

    def start(*args: str, env: dict[str, str] | None = None, **defaults: str) -> Launcher:
        flags = {"--port": "0", "--lease-ttl": "3", "--workers": "1",
                 **{f"--{name.replace('_', '-')}": value for name, value in defaults.items()}}
        argv = [sys.executable, "-m", "cortex.edge.main", "up", "--zero-cost",
                "--log-dir", str(tmp_path / "logs"), "--state-file", str(tmp_path / "state.json")]
        for flag, value in flags.items():
            argv += [flag, value]
        out, err = tmp_path / "up.out", tmp_path / "up.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen([*argv, *args], stdout=stdout, stderr=stderr,
                                    stdin=subprocess.DEVNULL, env=env)
        launcher = Launcher(proc, tmp_path / "state.json", out, err)
        launched.append(launcher)
        return launcher

    yield start
    for launcher in launched:  # a failed test must not leave a cluster behind
        launcher.stop()


def printed_commands(stdout: str) -> list[str]:
    """The shell commands the summary prints (``curl`` lines with their continuations)."""
    commands, current = [], ""
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("curl ") or current:
            current += line.removesuffix("\\")
            if not line.endswith("\\"):
                commands.append(current)
                current = ""
    return commands


def test_up_serves_the_printed_curl_and_sigterm_stops_every_process(launch: Any) -> None:
    up = launch(workers="2")
    state = up.wait_state()

    assert [w["id"] for w in state["workers"]] == ["worker-0", "worker-1"]
    for worker in state["workers"]:
        assert (worker["engine"], worker["role"], worker["model"]) == (
            "sglang", "regular", "cortex-sim")
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", worker["kv_events"])
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", worker["replay"])
        assert worker["url"].startswith("http://127.0.0.1:")
    assert state["redis"]["url"].startswith("redis://127.0.0.1:")
    assert re.fullmatch(r"127\.0\.0\.1:\d+", state["index"]["grpc"])
    assert isinstance(state["index"]["metrics_port"], int)
    query_token = Path(state["index"]["query_token_file"]).read_text()
    assert asyncio.run(_workers_status(state["index"]["grpc"], None)) == "UNAUTHENTICATED"
    assert asyncio.run(_workers_status(state["index"]["grpc"], query_token)) == "OK"
    assert isinstance(state["ingest"]["metrics_port"], int)
    assert len(state["gateways"]) == 1 and state["gateways"][0]["url"] in up.stdout()
    started = pids(state)
    assert len(started) == 6 and not any(gone(pid) for pid in started.values())

    curl, explain = printed_commands(up.stdout())
    result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    head, _, body = result.stdout.partition("\n\n")  # text mode: CRLF became LF
    assert head.startswith("HTTP/1.1 200")
    headers = dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])
    assert headers["x-cortex-assigned-worker"] in ("worker-0", "worker-1")
    assert headers["x-cortex-match-mode"] in ("exact_kv", "load_aware")
    assert json.loads(body)["usage"]["completion_tokens"] > 0
    repeat = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=30)
    assert "x-cortex-match-mode: exact_kv" in repeat.stdout  # the quickstart's second run
    explained = subprocess.run(["bash", "-c", explain], capture_output=True, text=True,
                               timeout=30)
    assert json.loads(explained.stdout)["decision"]["worker"] in ("worker-0", "worker-1")

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0
    assert not up.state_file.exists()
    assert all(gone(pid) for pid in started.values()), started
    assert "everything stopped" in up.stdout()


async def _workers_status(target: str, token: str | None) -> str:
    """The gRPC status of an index ``Workers`` call presenting ``token``."""
    async with index_channel(target) as channel:
        try:
            await IndexStub(channel, timeout=10, token=token).workers(pb.WorkersRequest())
        except GRPCError as exc:
            return exc.status.name
    return "OK"


def test_a_crashed_child_is_reported_and_ctrl_c_still_stops_the_rest(launch: Any) -> None:
    up = launch()
    state = up.wait_state()
    started = pids(state)
    os.kill(started["worker-0"], signal.SIGKILL)

    wait_until(lambda: "worker-0 exited with code -9" in up.stderr(), timeout=10,
               what="the launcher to report the crash")
    assert up.proc.poll() is None  # the rest keeps running

    up.proc.send_signal(signal.SIGINT)
    assert up.wait_exit() == 0
    assert all(gone(pid) for pid in started.values()), started


def test_every_child_dies_with_a_killed_launcher(launch: Any) -> None:
    up = launch(gateways="0")
    started = pids(up.wait_state())
    assert set(started) == {"redis", "index", "ingest", "worker-0"}

    up.proc.kill()
    up.wait_exit()

    wait_until(lambda: all(gone(pid) for pid in started.values()), timeout=20,
               what="the children to die with the launcher")
    # SIGKILL left its state file behind: the next start replaces it instead of trusting it
    assert json.loads(up.state_file.read_text())["launcher_pid"] == up.proc.pid
    again = launch(gateways="0")

    def replaced() -> bool:
        assert again.proc.poll() is None, again.stderr()
        with contextlib.suppress(FileNotFoundError, ValueError):
            return bool(json.loads(again.state_file.read_text())["launcher_pid"]
                        == again.proc.pid)
        return False

    wait_until(replaced, timeout=START_TIMEOUT_S, interval=0.05, what="a fresh state file")
    assert "removed the stale state file" in again.stdout()
    # and a running launcher's file is not taken over
    third = launch(gateways="0")
    assert third.wait_exit() == 1
    assert f"belongs to a running cortex up (pid {again.proc.pid})" in third.stderr()


def test_workers_0_runs_the_services_for_workers_registered_by_hand(
    launch: Any, tmp_path: Path,
) -> None:
    up = launch(workers="0")
    state = up.wait_state()
    assert state["workers"] == [] and state["gateways"]
    assert "cortex workers add --redis" in up.stdout()
    gateway = state["gateways"][0]["url"]

    with SimProcess("--engine", "sglang", "--port", "0", "--kv-events-port", "0",
                    "--replay-port", "0", "--zero-cost") as sim:
        added = subprocess.run(
            [sys.executable, "-m", "cortex.edge.main", "workers", "add", "--redis",
             state["redis"]["url"], "--id", "by-hand", "--url", sim.url, "--engine", "sglang",
             "--model", state["model"], "--kv-events", sim.kv_events_endpoint,
             "--replay", str(sim.replay_endpoint), "--block-size", "16", "--ttl", "3"],
            capture_output=True, text=True, timeout=30)
        assert added.returncode == 0, added.stderr

        def routable() -> bool:
            ready = subprocess.run(["curl", "-s", gateway + "/health/ready"],
                                   capture_output=True, text=True, timeout=10)
            try:
                return bool(json.loads(ready.stdout)["status"] == "ready")
            except (ValueError, KeyError, TypeError):
                return False  # not answering yet

        wait_until(routable, timeout=20, interval=0.1, what="the gateway to route to it")
        body = json.dumps({"model": state["model"], "max_tokens": 4,
                           "messages": [{"role": "user", "content": "hello by hand"}]})
        answer = subprocess.run(
            ["curl", "-si", gateway + "/v1/chat/completions", "-H",
             "content-type: application/json", "-d", body],
            capture_output=True, text=True, timeout=30)
        assert "x-cortex-assigned-worker: by-hand" in answer.stdout

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0


def test_an_external_redis_gets_the_workers_and_loses_them_at_exit(
    launch: Any, redis_server: RedisServer,
) -> None:
    def listed() -> list[dict[str, Any]]:
        result = subprocess.run(
            [sys.executable, "-m", "cortex.edge.main", "workers", "list", "--redis",
             redis_server.url, "--json"], capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        found: list[dict[str, Any]] = json.loads(result.stdout)["workers"]
        return found

    up = launch("--redis-url", redis_server.url, gateways="0")
    state = up.wait_state()
    assert state["redis"] == {"url": redis_server.url, "pid": None, "log": None}
    assert [w["id"] for w in listed()] == ["worker-0"]

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0
    assert listed() == []


def test_missing_redis_server_is_a_clear_error_naming_the_fix(launch: Any,
                                                              tmp_path: Path) -> None:
    empty = tmp_path / "bin"
    empty.mkdir()
    up = launch(env={**os.environ, "PATH": str(empty)})
    assert up.wait_exit() == 1
    message = up.stderr()
    assert "redis-server not found" in message
    assert "apt-get install redis-server" in message and "--redis-url" in message
    assert not (tmp_path / "logs").exists() or not any((tmp_path / "logs").glob("*.log"))


def test_a_taken_gateway_port_is_refused_with_the_fix(launch: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = launch(port=str(port))
        assert up.wait_exit() == 1
    assert f"port {port} on 127.0.0.1 is already in use" in up.stderr()
    assert "--port 0" in up.stderr()


def test_up_envoy_puts_a_real_envoy_in_front_of_the_picker(launch: Any) -> None:
    if envoy_binary() is None:
        pytest.skip(f"envoy not found: {ENVOY_HINT}")
    up = launch("--envoy", workers="2")
    state = up.wait_state()
    envoy = state["envoy"]
    assert envoy["body_mode"] == "duplex" and envoy["url"] in up.stdout()
    curl, _ = printed_commands(up.stdout())
    assert envoy["url"] in curl
    answers = [subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                              timeout=30).stdout.lower() for _ in range(2)]
    for answer in answers:
        assert answer.startswith("http/1.1 200") and "server: envoy" in answer
    workers = [re.findall(r"x-cortex-assigned-worker: (\S+)", a) for a in answers]
    assert workers[0] == workers[1] and workers[0][0] in ("worker-0", "worker-1")
    assert int(re.findall(r"x-cortex-cache-hit-tokens: (\d+)", answers[1])[0]) > 0
    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0
    assert gone(envoy["pid"])


def test_invalid_arguments_exit_2(launch: Any) -> None:
    up = launch("--pd", workers="1")
    assert up.wait_exit() == 2
    assert "pd: a prefill/decode pool needs workers >= 2" in up.stderr()
    up = launch("--envoy", "--pd", workers="2")
    assert up.wait_exit() == 2
    assert "prefill/decode pairs go through the gateway" in up.stderr()
