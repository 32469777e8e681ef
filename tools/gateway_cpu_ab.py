"""Gateway CPU per request, two source trees side by side, in front of one ``cortex up``.

    .venv/bin/cortex up --workers 2 --engine vllm --state-file /tmp/up.json &
    .venv/bin/python tools/gateway_cpu_ab.py --state /tmp/up.json \
        --tree before=/tmp/main --tree after=. --rounds 6 --requests 40

Each tree (a checkout with its own ``make venv``) runs one ``cortex gateway`` with the
cluster's gateway config (another port and id); the hypercorn + aiohttp relay of
``cortex bench overhead`` (``floor_main proxy``) runs beside them in front of the first
worker, as the floor. Every round sends the same sequential, streamed multi-turn chat
(``cortex bench routing --real-engines``' workload: ``Conversations`` and its keep-alive
``Client``; prompts up to ~3,200 tokens, 4-24 output tokens) to each target in turn (the
order alternates), and reads each process's CPU (user + system, ``/proc``) before and after:
CPU per request per process, medians over the rounds. Sequential requests are what the
real-engine benchmark sends; per request they pay every wake-up of the event loop that a
closed loop under load shares between requests. Background CPU (health, load polls, the
ledger replica) is measured idle first and reported beside it. Not a test: a measuring
tool, its output goes into a report (docs/bench/overhead.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from cortex.bench.procstat import cpu_s
from cortex.bench.routing.real import Client, Conversations


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _cpu(pid: int) -> float:
    value = cpu_s(pid)
    if value is None:
        raise SystemExit(f"process {pid} exited")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state", required=True, help="cortex up --state-file")
    parser.add_argument("--tree", action="append", required=True,
                        help="NAME=PATH of a checkout with its .venv (repeat)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=40, help="per round and target")
    parser.add_argument("--port", type=int, default=18180, help="first port to use")
    parser.add_argument("--fixed-tokens", type=int, default=0,
                        help="instead of the chat: one short question answered with exactly "
                             "this many streamed tokens (two runs give the CPU per event)")
    parser.add_argument("--log-dir", default="/tmp", help="where the processes log")
    args = parser.parse_args()
    state = json.loads(Path(args.state).read_text())
    model = state["model"]
    config = json.loads(Path(state["gateways"][0]["config"]).read_text())
    trees = dict(t.split("=", 1) for t in args.tree)
    procs: dict[str, subprocess.Popen[bytes]] = {}
    urls: dict[str, str] = {}
    logs = Path(args.log_dir)
    try:
        for i, (name, tree) in enumerate(trees.items()):
            port = args.port + i
            cfg = {**config, "gateway_id": f"gateway-{name}",
                   "server": {**config["server"], "port": port}}
            path = logs / f"gateway-{name}.json"
            path.write_text(json.dumps(cfg))
            with open(logs / f"gateway-{name}.log", "wb") as log:
                procs[name] = subprocess.Popen(
                    [f"{tree}/.venv/bin/cortex", "gateway", "--config", str(path),
                     "--log-level", "warning"], stdout=log, stderr=log)
            urls[name] = f"http://127.0.0.1:{port}"
        floor_port = args.port + len(trees)
        with open(logs / "relay-floor.log", "wb") as log:
            procs["relay floor"] = subprocess.Popen(
                [f"{next(iter(trees.values()))}/.venv/bin/python", "-c",
                 "from cortex.bench.overhead import floor_main; floor_main()", "proxy",
                 str(floor_port), state["workers"][0]["url"]], stdout=log, stderr=log)
        urls["relay floor"] = f"http://127.0.0.1:{floor_port}"
        for name in trees:
            deadline = time.monotonic() + 120
            while not _ready(urls[name] + "/health/ready"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name} not ready")
                time.sleep(0.2)
        # the encoder's parity probe runs in the background after start (and the floor
        # starts meanwhile)
        time.sleep(20)
        idle = {}
        for name, proc in procs.items():
            before = _cpu(proc.pid)
            time.sleep(5)
            idle[name] = (_cpu(proc.pid) - before) / 5
        rows: dict[str, list[float]] = {name: [] for name in urls}
        for r in range(args.rounds):
            order = list(urls) if r % 2 == 0 else list(urls)[::-1]
            for name in order:
                chats, client = Conversations(32, seed=r), Client()
                pid = procs[name].pid
                before = _cpu(pid)
                for _ in range(args.requests):
                    i, messages = chats.next()
                    body = {"model": model, "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": True,
                            "temperature": 0, "max_tokens": chats.rng.randrange(4, 24)}
                    if args.fixed_tokens:
                        body["messages"] = [{"role": "user", "content": "A short question."}]
                        body["max_tokens"] = args.fixed_tokens
                    shot, answer = client.stream(urls[name], body)
                    chats.answered(i, messages, answer, shot.prompt_tokens)
                client.close()
                rows[name].append((_cpu(pid) - before) / args.requests * 1e3)
                print(f"round {r} {name}: {rows[name][-1]:.2f} ms CPU per request",
                      flush=True)
        print("\n| process | CPU per request, median (ms) | rounds (ms) | idle CPU (ms/s) |")
        print("|---|---|---|---|")
        for name, values in rows.items():
            print(f"| {name} | {statistics.median(values):.2f} | "
                  f"{', '.join(f'{v:.2f}' for v in values)} | {idle[name] * 1e3:.1f} |")
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            proc.wait()


if __name__ == "__main__":
    main()
