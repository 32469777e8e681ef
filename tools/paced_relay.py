"""A gateway's CPU per streamed request when the answer's events come one by one, as a real
engine decodes them (not all at once, as from the zero-cost sims of ``cortex bench
overhead``'s closed loop), per worker HTTP client, against the relay floor.

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/paced_relay.py \
        --clients lean,floor,raw --tokens 2,65 --requests 60 --rounds 2 \
        --out docs/bench/paced_relay

For each ``upstream.http_client``, a ``cortex up`` deployment (2 simulated SGLang workers that
decode one token every ``--decode-ms`` ms) serves one client sending ``--requests``
sequential streamed chat requests (a 600-word system prompt shared by all, a new 60-word
user turn each) of each ``--tokens`` answer length, ``--warm-s`` after start-up; ``floor``
sends them instead to ``cortex bench overhead``'s relay floor (hypercorn relaying with
aiohttp, no routing), ``raw`` to its raw floor (asyncio protocols passing bytes, no HTTP
library: what any Python relay pays at least), in front of the same sims. The server's CPU
(``/proc``) over those requests, less its idle draw (measured alone for ``--idle-s`` after
them), per request; the slope between the shortest and the longest answer is the relay's
cost per streamed event.
Rounds alternate the servers. Not a test: a measuring tool for docs/bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from cortex.bench.procstat import cpu_s
from cortex.testing import free_port

SYSTEM = " ".join(f"w{i}" for i in range(600))


async def _requests(url: str, count: int, tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        for i in range(count):
            user = f"q{seed}-{i} " + " ".join(rng.choice("abcdefg") for _ in range(60))
            body = {"model": "cortex-sim", "stream": True, "max_tokens": tokens,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": user}]}
            async with session.post(url + "/v1/chat/completions", json=body) as response:
                if response.status != 200:
                    raise SystemExit(f"status {response.status}: {await response.text()}")
                async for _ in response.content:
                    pass


FLOOR = "from cortex.bench.overhead import floor_main; floor_main()"
FLOORS = {"floor": "proxy", "raw": "raw"}  # --clients that name a floor: its floor_main mode


def _measure(client: str, tokens: list[int], requests: int, decode_ms: float,
             warm_s: float, idle_s: float, seed: int) -> dict[str, float]:
    """One deployment with ``client`` (``floor``: hypercorn relaying to the first worker
    with aiohttp, no routing; ``raw``: asyncio protocols passing bytes, no HTTP library;
    either measured instead of the gateway): ms of that server's CPU per
    request beyond idle, per answer length, and its idle draw (ms/s)."""
    floor: subprocess.Popen[bytes] | None = None
    with tempfile.TemporaryDirectory(prefix="paced-relay-") as tmp:
        state = Path(tmp) / "state.json"
        env = {**os.environ,
               "CORTEX_GATEWAY_UPSTREAM_HTTP_CLIENT": "lean" if client in FLOORS else client}
        up = subprocess.Popen(
            [str(Path(sys.executable).with_name("cortex")), "up", "--workers", "2",
             "--port", "0", "--state-file", str(state), "--log-dir", str(Path(tmp) / "logs"),
             "--sim-args", f"--decode-ms-per-token {decode_ms} --prefill-ms-per-token 0.05"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            deadline = time.monotonic() + 120
            while not state.exists():
                if up.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("cortex up did not become ready")
                time.sleep(0.2)
            described = json.loads(state.read_text())
            pid, url = described["gateways"][0]["pid"], described["gateways"][0]["url"]
            if client in FLOORS:
                port = free_port()
                floor = subprocess.Popen([sys.executable, "-c", FLOOR, FLOORS[client],
                                          str(port), described["workers"][0]["url"]],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                pid, url = floor.pid, f"http://127.0.0.1:{port}"
                _wait_answering(url, seed)
            asyncio.run(_requests(url, 5, 2, seed))  # connections and caches warm
            time.sleep(warm_s)  # start-up work (tokenizer self-checks, first polls) done
            used: dict[int, tuple[float, float]] = {}
            for count in tokens:
                start, began = cpu_s(pid) or 0.0, time.monotonic()
                asyncio.run(_requests(url, requests, count, seed + count))
                used[count] = ((cpu_s(pid) or 0.0) - start, time.monotonic() - began)
            start, began = cpu_s(pid) or 0.0, time.monotonic()
            time.sleep(idle_s)  # the idle draw, after the requests: nothing warming up
            idle = ((cpu_s(pid) or 0.0) - start) / (time.monotonic() - began)
            out = {"idle_ms_per_s": round(idle * 1000, 2)}
            for count, (cpu, wall) in used.items():
                out[str(count)] = round((cpu - idle * wall) / requests * 1000, 3)
            return out
        finally:
            if floor is not None:
                floor.terminate()
                floor.wait(timeout=60)
            up.terminate()
            up.wait(timeout=60)


def _wait_answering(url: str, seed: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            asyncio.run(_requests(url, 1, 2, seed))
            return
        except (aiohttp.ClientError, OSError):
            if time.monotonic() > deadline:
                raise SystemExit(f"{url} does not answer") from None
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="lean,floor,raw",
                        help="worker clients (and `floor`: the hypercorn + aiohttp relay; "
                             "`raw`: a relay of bare asyncio protocols)")
    parser.add_argument("--tokens", default="2,65", help="answer lengths (tokens), comma list")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--decode-ms", type=float, default=12.0)
    parser.add_argument("--warm-s", type=float, default=15.0)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    clients = args.clients.split(",")
    tokens = sorted(int(t) for t in args.tokens.split(","))
    runs: dict[str, list[dict[str, float]]] = {c: [] for c in clients}
    for round_ in range(args.rounds):
        for client in clients if round_ % 2 == 0 else list(reversed(clients)):
            result = _measure(client, tokens, args.requests, args.decode_ms, args.warm_s,
                              args.idle_s, seed=round_)
            runs[client].append(result)
            print(f"round {round_} {client}: {result}", flush=True)
    lines = [
        "# The relay's cost per streamed event (`tools/paced_relay.py`)", "",
        f"`tools/paced_relay.py --clients {args.clients} --tokens {args.tokens} --requests "
        f"{args.requests} --decode-ms {args.decode_ms:g} --rounds {args.rounds}` — "
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores.", "",
        "One client, sequential streamed chat requests through `cortex up`'s gateway (2 sims "
        f"decoding a token every {args.decode_ms:g} ms, so every event comes alone, as from "
        "a real engine), or through the relay floor (hypercorn relaying with aiohttp, no "
        "routing) or the raw floor (asyncio protocols passing bytes, no HTTP library) in "
        "front of the same sims. The server's CPU per request beyond its idle "
        "draw, ms (median of rounds); *per event*: the slope between the shortest and the "
        "longest answer.", "",
        "| server (worker client) | idle ms/s | " + " | ".join(f"{t} tokens" for t in tokens)
        + " | per event |",
        "|---|---|" + "---|" * len(tokens) + "---|",
    ]
    for client, results in runs.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        slope = (med[str(tokens[-1])] - med[str(tokens[0])]) / (tokens[-1] - tokens[0])
        lines.append(f"| {client} | {med['idle_ms_per_s']:.1f} | "
                     + " | ".join(f"{med[str(t)]:.2f}" for t in tokens)
                     + f" | {slope * 1000:.0f} µs |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "report.md").write_text(report)


if __name__ == "__main__":
    main()
