"""``cortex up``: a whole Cortex cluster on this machine, in one command.

Starts a private ``redis-server``, the index, the ingest, one or more gateway replicas and
simulated workers (:class:`cortex.devcluster.cluster.LocalCluster`), registers the workers, waits
until every part is ready, prints what runs where with a ready-to-paste ``curl``, and runs
until Ctrl-C / SIGTERM, then stops everything. A process that crashes meanwhile is reported
(with its log tail) and the rest keeps running. Exit codes: 0 after a clean stop, 1 when the
cluster could not start, 2 on invalid arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = ["launch", "register", "run", "spec_from_args", "summary"]

# long enough to fill a few KV blocks, so a repeated request shows a cache hit
QUICKSTART_SYSTEM_PROMPT = (
    "You are the Cortex quickstart assistant. Answer in one short sentence, say which "
    "worker you run on when asked, and never invent facts about caches, tokens or GPUs.")


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    from cortex.devcluster.cluster import DEFAULT_GATEWAY_PORT, ClusterSpec

    defaults = ClusterSpec()
    parser = subparsers.add_parser(
        "up", help="run a local dev cluster: Redis, index, ingest, gateways, simulated workers",
        description="Start a local Cortex cluster (private redis-server, index, ingest, "
                    "gateway replicas, simulated SGLang/vLLM workers), wait until it is ready, "
                    "print what runs where, and stop it all on Ctrl-C / SIGTERM.")
    workers = parser.add_argument_group("workers (cortex sim)")
    workers.add_argument("--workers", type=int, default=defaults.workers, metavar="N",
                         help="simulated workers (0 = the services alone, register workers "
                              "by hand with `cortex workers add`; default %(default)s)")
    workers.add_argument("--engine", choices=["sglang", "vllm"], default=defaults.engine.value,
                         help="engine the workers simulate (default %(default)s)")
    workers.add_argument("--pd", action="store_true",
                         help="a prefill/decode pool: ceil(N/2) prefill and the rest decode "
                              "workers (N >= 2)")
    workers.add_argument("--model", default=defaults.model,
                         help="served model name (default %(default)s)")
    workers.add_argument("--block-size", type=int, default=defaults.block_size,
                         help="tokens per KV block (default %(default)s)")
    workers.add_argument("--kv-capacity-blocks", type=int, default=defaults.kv_capacity_blocks,
                         help="each worker's KV pool (blocks; default %(default)s)")
    workers.add_argument("--max-running", type=int, default=defaults.max_running,
                         help="requests each worker serves at once (default %(default)s)")
    workers.add_argument("--zero-cost", action="store_true",
                         help="no simulated prefill/decode time")
    workers.add_argument("--sim-args", default="", metavar="'ARGS'",
                         help="more `cortex sim` flags for every worker, e.g. "
                              "--sim-args='--prefill-ms-per-token 0.05'")
    gateways = parser.add_argument_group("gateways")
    gateways.add_argument("--gateways", type=int, default=defaults.gateways, metavar="N",
                          help="gateway replicas (0 = none; default %(default)s)")
    gateways.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                          help="first gateway's port; replica i listens on PORT+i "
                               "(0 = free ports; default %(default)s)")
    gateways.add_argument("--host", default=defaults.host,
                          help="gateways' bind address (0.0.0.0 to reach them from elsewhere; "
                               "default %(default)s)")
    gateways.add_argument("--envoy", nargs="?", const="duplex", choices=["buffered", "duplex"],
                          default=None, metavar="MODE",
                          help="put a real Envoy in front (make envoy): the gateway serves the "
                               "endpoint picker, Envoy calls it over ext_proc with request body "
                               "mode MODE (duplex: FULL_DUPLEX_STREAMED, the default; buffered) "
                               "and forwards to the worker it names (docs/kubernetes.md)")
    gateways.add_argument("--lease-ttl", type=float, default=defaults.lease_ttl_s, metavar="S",
                          help="worker registry lease (s), renewed by the gateways' probes "
                               "(default %(default)s)")
    parser.add_argument("--redis-url", default=None,
                        help="use this Redis instead of starting a private redis-server")
    parser.add_argument("--log-dir", default=None,
                        help="where each process logs (default: a new temporary directory)")
    parser.add_argument("--state-file", default=None, metavar="FILE",
                        help="write a JSON description of every process here once ready "
                             "(removed on exit)")
    parser.add_argument("--ready-timeout", type=float, default=defaults.ready_timeout_s,
                        metavar="S", help="give up if the cluster is not ready by then "
                                          "(default %(default)s)")
    parser.set_defaults(func=run)


def spec_from_args(args: argparse.Namespace) -> Any:
    """The :class:`ClusterSpec` of the command line (``ValueError`` when invalid)."""
    from cortex.devcluster.cluster import ClusterSpec
    from cortex.testing import free_port

    gateway_args: tuple[str, ...] = ()
    if getattr(args, "envoy", None):
        if args.gateways != 1 or args.pd:
            raise ValueError("--envoy: one gateway (it serves the picker) and regular workers "
                             "(prefill/decode pairs go through the gateway: docs/kubernetes.md)")
        gateway_args = ("--epp-host", "127.0.0.1", "--epp-port", str(free_port()))
    return ClusterSpec(
        workers=args.workers, engine=args.engine, pd=args.pd, gateways=args.gateways,
        port=args.port, host=args.host, redis_url=args.redis_url, model=args.model,
        block_size=args.block_size, kv_capacity_blocks=args.kv_capacity_blocks,
        max_running=args.max_running, zero_cost=args.zero_cost,
        sim_args=tuple(shlex.split(args.sim_args)), lease_ttl_s=args.lease_ttl,
        ready_timeout_s=args.ready_timeout, gateway_args=gateway_args)


class _Stop(BaseException):
    """Ctrl-C or SIGTERM: leave the cluster's ``with`` block, which stops everything."""


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # one stop is enough: further signals must not interrupt the shutdown itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop(signal.Signals(signum).name)


def run(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"cortex up: invalid arguments: {exc}", file=sys.stderr)
        return 2
    return launch(spec, args)


def launch(spec: Any, args: argparse.Namespace, command: str = "cortex up") -> int:
    """Run the cluster of ``spec`` until a signal (``args``: ``state_file``, ``log_dir``):
    the whole life of ``cortex up`` and ``cortex serve`` once their spec is built."""
    from cortex.devcluster.cluster import ClusterError, LocalCluster

    state_file = Path(args.state_file) if args.state_file else None
    if state_file is not None:
        owner = _claim_state_file(state_file, command)
        if owner is not None:
            print(f"{command}: {state_file} belongs to a running {command} (pid {owner}): stop "
                  "it first, or pass another --state-file", file=sys.stderr)
            return 1
    prefix = command.replace(" ", "-") + "-"
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix=prefix))
    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    print(f"{command}: starting (logs in {log_dir}) ...", flush=True)
    started = time.monotonic()
    try:
        with LocalCluster(spec, log_dir) as cluster, contextlib.ExitStack() as stack:
            state = cluster.state()
            if getattr(args, "envoy", None):
                state["envoy"] = _start_envoy(stack, spec, state, args.envoy)
            print(summary(state, time.monotonic() - started, command), flush=True)
            if state_file is not None:  # after the summary: its presence says it is printed
                _write_json(state_file, state)
            _watch(cluster, command)
    except _Stop as stop:
        print(f"{command}: {stop} received, everything stopped", flush=True)
        return 0
    except ClusterError as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if state_file is not None:
            state_file.unlink(missing_ok=True)
    return 0  # pragma: no cover - _watch only returns by a signal


def _start_envoy(stack: contextlib.ExitStack, spec: Any, state: dict[str, Any],
                 mode: str) -> dict[str, Any]:
    """Envoy in front of the picker the gateway serves (``--epp-port``), routing to the
    workers; what it is, for the state file."""
    from urllib.parse import urlsplit

    from cortex.testing.envoy import EnvoyProxy

    args = list(spec.gateway_args)
    picker = f"127.0.0.1:{args[args.index('--epp-port') + 1]}"
    endpoints = [urlsplit(w["url"]).netloc for w in state["workers"]]
    proxy = stack.enter_context(EnvoyProxy(picker=picker, endpoints=endpoints, body_mode=mode))
    return {"url": proxy.url, "admin_url": f"http://127.0.0.1:{proxy.admin_port}",
            "picker": picker, "body_mode": mode, "pid": proxy.pid,
            "config": proxy.config}


def _watch(cluster: Any, command: str) -> None:
    """Report every process that crashes (once, with its log tail) until a signal stops us."""
    reported: set[str] = set()
    while True:
        for child in cluster.crashed():
            if child.name not in reported:
                reported.add(child.name)
                print(f"{command}: {child.name} exited with code {child.returncode}; the rest "
                      f"keeps running. Last log lines ({child.log_path}):\n{child.log_tail(2000)}",
                      file=sys.stderr, flush=True)
        time.sleep(0.5)


def _claim_state_file(path: Path, command: str) -> int | None:
    """Make ``path`` ours: ``None`` once it is absent — a file left by a launcher that died
    (SIGKILL, a crash) is removed, so nobody mistakes it for a running cluster — or the pid
    of the live ``cortex up`` that owns it."""
    try:
        owner = json.loads(path.read_text()).get("launcher_pid")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        owner = None  # unreadable: nobody can be using it
    if isinstance(owner, int) and owner != os.getpid() and _is_launcher(owner):
        return owner
    path.unlink(missing_ok=True)
    print(f"{command}: removed the stale state file {path} (launcher pid {owner} is gone)",
          flush=True)
    return None


def _is_launcher(pid: int) -> bool:
    """Whether ``pid`` is a live ``cortex`` process (not a stranger that reused the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's: leave its file alone
    try:
        return b"cortex" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc: trust that the pid is alive


def _write_json(path: Path, document: dict[str, Any]) -> None:
    """Write atomically (readers see the whole object or no file), private to the user: it
    holds the admin token."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(json.dumps(document, indent=2) + "\n")
    os.replace(tmp, path)


def summary(state: dict[str, Any], seconds: float, command: str = "cortex up") -> str:
    """The human-readable what-runs-where of a cluster ``state()``."""
    workers = state["workers"]
    gateways = state["gateways"]
    engines = "/".join(sorted({w["engine"] for w in workers})) or state["engine"]
    models = ", ".join(repr(m) for m in sorted({w["model"] for w in workers} or {state["model"]}))
    lines = [f"{command}: ready in {seconds:.1f} s: {len(workers)} {engines} worker(s)"
             f"{' (prefill/decode pool)' if state['pd'] else ''}, {len(gateways)} gateway(s), "
             f"model {models}. Logs: {state['log_dir']}", ""]
    rows: list[tuple[str, str, str]] = []
    for gw in gateways:
        rows.append((gw["id"], gw["url"], f"metrics {gw['metrics_url']}"))
    if state["index"]:
        rows.append(("index", f"grpc {state['index']['grpc']}",
                     f"metrics {state['index']['metrics_url']}"))
    if state["ingest"]:
        rows.append(("ingest", state["ingest"]["health_url"],
                     f"metrics {state['ingest']['metrics_url']}"))
    if state["redis"]:
        rows.append(("redis", state["redis"]["url"], ""))
    envoy = state.get("envoy")
    if envoy:
        rows.append(("envoy", envoy["url"], f"ext_proc to the picker {envoy['picker']} "
                     f"({envoy['body_mode']}), admin {envoy['admin_url']}"))
    for w in workers:
        events = (f"events {w['kv_events']}, replay {w['replay']}" if w["kv_events"]
                  else "no KV events: routed by load only")
        if w.get("ledger_pending"):
            events += f"; not yet READY ({w['ledger_pending']}): routed by load until it is"
        rows.append((w["id"], w["url"], f"{w['engine']} {w['role']}, {events}"))
    width = max((len(r[0]) for r in rows), default=0)
    url_width = max((len(r[1]) for r in rows), default=0)
    lines += [f"  {name:<{width}}  {url:<{url_width}}  {extra}".rstrip()
              for name, url, extra in rows]
    if not workers and state["redis"]:
        lines += ["", "No workers yet: register each one (its lease is renewed while it answers",
                  "the gateways' health probes):",
                  f"  cortex workers add --redis {state['redis']['url']} --url URL",
                  "(engine, model, block size and event endpoints are read from the worker's",
                  "own endpoints; flags such as --model or --kv-events tcp://HOST:PORT win)"]
    if gateways:
        url = envoy["url"] if envoy else gateways[0]["url"]
        body = json.dumps({"model": state["model"], "max_tokens": 16, "messages": [
            {"role": "system", "content": QUICKSTART_SYSTEM_PROMPT},
            {"role": "user", "content": "What does a KV-cache-aware router do?"}]})
        second = ("x-cortex-cache-hit-tokens > 0 (through Envoy: the picker routed it)" if envoy
                  else "x-cortex-match-mode: exact_kv")
        lines += [
            "",
            "Try it, twice (the x-cortex-* response headers say which worker served the",
            "request, how it was routed and how many prompt tokens were already cached there;",
            f"the second run lands on the same worker with {second}):",
            f"  curl -si {url}/v1/chat/completions -H 'content-type: application/json' \\",
            f"    -d '{body}'",
            "",
            "Why a worker was chosen (admin API; the token is in the gateway configs):",
            f"  curl -s {gateways[0]['url']}/admin/explain "
            f"-H 'authorization: Bearer {state['admin_token']}' \\",
            f"    -d '{body}'",
        ]
    lines += ["", "Ctrl-C stops everything."]
    return "\n".join(lines)
