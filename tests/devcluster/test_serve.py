"""``cortex serve`` as an operator runs it, in front of workers that already run: simulated
SGLang and vLLM engines as real processes, the launcher as a child process, the printed
quickstart curl sent twice (the repeat is ``exact_kv`` on the first worker), SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cortex.registry import RedisRegistry, WorkerSpec
from cortex.sim.process import SimProcess
from cortex.testing import RedisServer, free_port, wait_until

from .test_up import Launcher, gone, printed_commands

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    launched: list[Launcher] = []

    def start(*args: str) -> Launcher:
        argv = [sys.executable, "-m", "cortex.edge.main", "serve", "--port", "0",
                "--lease-ttl", "3", "--log-dir", str(tmp_path / "logs"),
                "--state-file", str(tmp_path / "state.json"), *args]
        out, err = tmp_path / "serve.out", tmp_path / "serve.err"
        with open(out, "wb") as stdout, open(err, "wb") as stderr:
            proc = subprocess.Popen(argv, stdout=stdout, stderr=stderr,
                                    stdin=subprocess.DEVNULL)
        launcher = Launcher(proc, tmp_path / "state.json", out, err)
        launched.append(launcher)
        return launcher

    yield start
    for launcher in launched:  # a failed test must not leave a cluster behind
        launcher.stop()


@pytest.fixture
def start_sims() -> Iterator[Any]:
    """``start_sims(argv, ...)``: sim processes (launched at once, then each waited for),
    stopped at teardown."""
    with contextlib.ExitStack() as stack:

        def start(*argvs: tuple[str, ...]) -> list[SimProcess]:
            procs = [SimProcess("--port", "0", "--kv-events-port", "0", "--replay-port", "0",
                                "--zero-cost", "--model", "org/quick", *argv) for argv in argvs]
            for proc in procs:
                stack.callback(proc.close)
                proc.launch()
            for proc in procs:
                proc.wait_ready()
            return procs

        yield start


def curl(command: str) -> dict[str, str]:
    result = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    head, _, body = result.stdout.partition("\n\n")
    assert head.startswith("HTTP/1.1 200"), result.stdout
    assert json.loads(body)["usage"]["completion_tokens"] > 0
    return dict(line.lower().split(": ", 1) for line in head.splitlines()[1:])


def engines_idle(state: dict[str, Any]) -> bool:
    """Every worker's last polled engine load, as the first gateway saw it, is idle."""
    request = urllib.request.Request(state["gateways"][0]["url"] + "/admin/workers",
                                     headers={"Authorization": f"Bearer {state['admin_token']}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        workers = json.loads(response.read())["workers"]
    return all(w["engine_running"] == 0 and w["inflight"] == 0 for w in workers)


def service_pids(state: dict[str, Any]) -> list[int]:
    found = [g["pid"] for g in state["gateways"]]
    return found + [state[name]["pid"] for name in ("redis", "index", "ingest")
                    if state[name] and state[name].get("pid")]


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_serve_in_front_of_running_workers_routes_the_repeat_to_its_cache(
    serve: Any, start_sims: Any, engine: str,
) -> None:
    procs = start_sims(("--engine", engine), ("--engine", engine))
    urls = [proc.url for proc in procs]
    up = serve("--worker-urls", *urls)
    state = up.wait_state()
    workers = {w["url"]: w for w in state["workers"]}
    assert sorted(workers) == sorted(urls)
    for url in urls:
        worker = workers[url]
        assert (worker["engine"], worker["role"], worker["model"], worker["block_size"]) == (
            engine, "regular", "org/quick", 16)
        assert worker["kv_events"].startswith("tcp://127.0.0.1:") and worker["replay"]
    assert f"{urls[0]}: block_size = 16" in up.stdout()
    assert "warning: no --tokenizer-path" in up.stderr()
    started = service_pids(state)

    quickstart, _ = printed_commands(up.stdout())
    first = curl(quickstart)
    assert first["x-cortex-assigned-worker"] in {w["id"] for w in state["workers"]}
    # a load poll taken while the first request ran would still count it (issue 18's
    # stale-load item, fixed apart): repeat once the gateway has seen the workers idle
    wait_until(lambda: engines_idle(state), timeout=20, interval=0.05,
               what="the gateway to see the workers idle")
    repeat = curl(quickstart)
    assert repeat["x-cortex-match-mode"] == "exact_kv"
    assert repeat["x-cortex-assigned-worker"] == first["x-cortex-assigned-worker"]
    assert int(repeat["x-cortex-cache-hit-tokens"]) > 0

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0
    assert all(gone(pid) for pid in started)
    assert all(proc.proc is not None and proc.proc.poll() is None
               for proc in procs)  # the workers are not Cortex's to stop


def test_serve_a_prefill_decode_pool(serve: Any, start_sims: Any) -> None:
    prefill, decode = start_sims(("--engine", "sglang", "--role", "prefill",
                                  "--bootstrap-port", "0"),
                                 ("--engine", "sglang", "--role", "decode"))
    up = serve("--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url)
    state = up.wait_state()
    roles = {w["url"]: (w["role"], w["bootstrap_port"]) for w in state["workers"]}
    assert roles == {prefill.url: ("prefill", prefill.info["bootstrap_port"]),
                     decode.url: ("decode", None)}
    quickstart, _ = printed_commands(up.stdout())
    headers = curl(quickstart)
    ids = {w["url"]: w["id"] for w in state["workers"]}
    assert headers["x-cortex-prefill-worker"] == ids[prefill.url]
    assert headers["x-cortex-decode-worker"] == ids[decode.url]


def test_a_worker_that_cannot_describe_itself_stops_serve_naming_the_fields(
    serve: Any, start_sims: Any,
) -> None:
    (good,) = start_sims(("--engine", "vllm"),)
    dead = f"http://127.0.0.1:{free_port()}"
    up = serve("--worker-urls", good.url, dead, "--discovery-timeout", "2")
    assert up.wait_exit() == 2
    err = up.stderr()
    assert f"could not learn engine, model, block_size from {dead}" in err
    assert "cannot connect" in err and "(--engine, --model, --block-size)" in err
    assert good.url not in err  # the worker that answered is fine
    assert not up.state_file.exists() and not (up.state_file.parent / "logs").exists()


def test_serve_with_a_given_redis_registers_dp_workers_and_removes_them_at_exit(
    serve: Any, start_sims: Any, redis_server: RedisServer,
) -> None:
    (sim,) = start_sims(("--engine", "vllm", "--dp-size", "2"),)
    async def listed() -> dict[str, WorkerSpec]:
        async with RedisRegistry(redis_server.url) as registry:
            return dict((await registry.list()).workers)

    up = serve("--worker-urls", sim.url, "--redis-url", redis_server.url)
    state = up.wait_state()  # ready: both DP ranks' ledgers READY at the ingest
    assert state["redis"] == {"url": redis_server.url, "pid": None, "log": None}
    (spec,) = asyncio.run(listed()).values()
    assert (spec.url, spec.dp_size, spec.kv_events) == (
        sim.url, 2, f"tcp://127.0.0.1:{sim.info['kv_events_port']}")
    assert curl(printed_commands(up.stdout())[0])["x-cortex-assigned-worker"] == spec.id

    up.proc.send_signal(signal.SIGTERM)
    assert up.wait_exit() == 0
    assert asyncio.run(listed()) == {}


def test_a_worker_that_never_becomes_routable_is_named_when_start_up_gives_up(
    tmp_path: Path,
) -> None:
    from cortex.devcluster.cluster import ClusterError, ClusterSpec, LocalCluster
    from cortex.hashing import Engine

    dead = WorkerSpec(id="gone", url=f"http://127.0.0.1:{free_port()}", engine=Engine.VLLM,
                      model="m", block_size=16)
    spec = ClusterSpec(workers=0, port=0, external=(dead,), model="m", engine=Engine.VLLM,
                       lease_ttl_s=3, ready_timeout_s=12)  # the gateway itself must be up first
    with pytest.raises(ClusterError) as caught:
        LocalCluster(spec, tmp_path / "logs").start()
    message = str(caught.value)
    assert f"waiting for gone ({dead.url}): " in message, message
    assert "health unhealthy" in message and "connect: ConnectionRefusedError" in message


def test_workers_without_kv_events_are_ready_when_the_gateway_routes_them(
    start_sims: Any, tmp_path: Path,
) -> None:
    """No ledger to wait for: the gateway calls itself degraded (no_ready_ledger), routes by
    load, and start-up is done as soon as it does (it used to wait out the deadline)."""
    from cortex.devcluster.cluster import ClusterSpec, LocalCluster
    from cortex.devcluster.up import summary
    from cortex.hashing import Engine

    (sim,) = start_sims(("--engine", "vllm"),)
    worker = WorkerSpec(id="no-events", url=sim.url, engine=Engine.VLLM, model="org/quick",
                        block_size=16)
    spec = ClusterSpec(workers=0, port=0, external=(worker,), model="org/quick",
                       engine=Engine.VLLM, lease_ttl_s=3, ready_timeout_s=60)
    with LocalCluster(spec, tmp_path / "logs") as cluster:
        (row,) = [line for line in summary(cluster.state(), 1.0, "cortex serve").splitlines()
                  if sim.url in line]
        assert row.split()[0] == "no-events" and "no KV events: routed by load only" in row


def test_a_ledger_that_does_not_come_is_waited_for_a_grace_then_routed_by_load(
    start_sims: Any, tmp_path: Path,
) -> None:
    """An external worker whose events nobody publishes (a wrong endpoint, a firewall): the
    gateway serves it by load, so start-up ends after ``ledger_grace_s`` naming it."""
    from cortex.devcluster.cluster import ClusterSpec, LocalCluster
    from cortex.devcluster.up import summary
    from cortex.hashing import Engine

    (sim,) = start_sims(("--engine", "vllm"),)
    silent = WorkerSpec(id="silent", url=sim.url, engine=Engine.VLLM, model="org/quick",
                        block_size=16, kv_events=f"tcp://127.0.0.1:{free_port()}",
                        replay=f"tcp://127.0.0.1:{free_port()}")
    spec = ClusterSpec(workers=0, port=0, external=(silent,), model="org/quick",
                       engine=Engine.VLLM, lease_ttl_s=3, ready_timeout_s=60,
                       ledger_grace_s=1)
    with LocalCluster(spec, tmp_path / "logs") as cluster:
        assert list(cluster.ledger_pending) == ["silent"]
        (row,) = [line for line in summary(cluster.state(), 1.0, "cortex serve").splitlines()
                  if sim.url in line]
        assert "not yet READY (silent" in row and "routed by load until it is" in row
