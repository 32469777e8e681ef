"""Gateway CPU per streamed request, two source trees interleaved under ``cortex bench
overhead``'s closed loop, against its hypercorn + aiohttp relay floor.

    flock /tmp/cortex-heavy.lock .venv/bin/python tools/overhead_ab.py \
        --before /work/wt-lean-before/.venv/bin/python --rounds 8 --duration 5

Run with the *after* tree's interpreter; ``--before`` is the other tree's (a checkout with its
own ``make venv``), or this one's with ``--before-set KEY=VALUE`` (a dotted gateway config
key, e.g. ``upstream.http_client=aiohttp``; repeatable) to compare two configurations of one
tree. One cluster as ``cortex bench overhead`` builds it (2 zero-cost SGLang sims, index,
ingest), then three servers beside it: the relay floor (``floor_main proxy``,
in front of the first sim), a ``cortex gateway`` of each tree (the cluster's gateway config,
another port and id, the ``fastokens`` encoder chosen at start). Each is warmed (3 s), then
every round runs the closed loop (``--concurrency`` clients, ``--duration`` s) against each
in turn (the order alternates) and reads that process's CPU (``/proc``): CPU per request per
round, the ratio to the floor of the same round, medians. On a shared machine the rounds
spread: compare within rounds. Not a test: a measuring tool for docs/bench/overhead.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys

from cortex.bench import overhead
from cortex.testing import free_port

PROXY = "from cortex.bench.overhead import floor_main; floor_main()"


async def _run(args: argparse.Namespace) -> None:
    with overhead.cluster(with_router=False) as c:
        config = c.gateway_config()
        base = {**config, "tokenize": {**config.get("tokenize", {}), "encoder": "fastokens"}}
        servers = {}
        port = free_port()
        floor = c.extra.start("floor", [sys.executable, "-c", PROXY, "proxy", str(port),
                                        c.worker_urls[0]])
        overhead._wait_serving(floor, "", "relay", port)
        servers["relay"] = (floor, f"http://127.0.0.1:{port}")
        for name, python in (("before", args.before), ("after", sys.executable)):
            port = free_port()
            path = c.extra.log_dir / f"{name}.json"
            config = {**base, "gateway_id": f"gateway-{name}",
                      "server": {**base["server"], "port": port}}
            if name == "before":
                for setting in args.before_set:
                    _set(config, setting)
            path.write_text(json.dumps(config))
            gateway = c.extra.start(name, [python, "-m", "cortex.edge.main", "gateway",
                                           "--config", str(path), "--log-level", "warning"])
            url = f"http://127.0.0.1:{port}"
            overhead._wait_serving(gateway, url + "/health/ready", name)
            servers[name] = (gateway, url)
        for _, url in servers.values():  # caches and connections warm, not counted
            await overhead.throughput(c, [url], args.concurrency, 3)
        ms: dict[str, list[float]] = {name: [] for name in servers}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for name in order:
                process, url = servers[name]
                c.pids[name] = process.pid
                result = await overhead.throughput(c, [url], args.concurrency, args.duration)
                del c.pids[name]
                ms[name].append(result.cpu_s[name] * 1000 / max(result.requests, 1))
                print(f"round {round_} {name}: {result.rate:.0f} req/s, "
                      f"{ms[name][-1]:.3f} ms CPU per request, {result.errors} errors",
                      flush=True)
        for name, values in ms.items():
            print(f"{name}: median {statistics.median(values):.3f} ms "
                  f"({', '.join(f'{v:.3f}' for v in values)})")
        for name in ("before", "after"):
            ratios = [g / f for g, f in zip(ms[name], ms["relay"], strict=True)]
            print(f"{name} / relay: median of rounds {statistics.median(ratios):.2f}x "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})")
        saved = [b - a for b, a in zip(ms["before"], ms["after"], strict=True)]
        print(f"before - after: median of rounds {statistics.median(saved):.3f} ms")


def _set(config: dict[str, object], setting: str) -> None:
    """Apply ``a.b=value`` (``value`` read as JSON when it parses, else a string)."""
    key, sep, text = setting.partition("=")
    if not sep:
        raise SystemExit(f"--before-set {setting!r}: expected KEY=VALUE")
    try:
        value: object = json.loads(text)
    except ValueError:
        value = text
    *sections, last = key.split(".")
    node = config
    for section in sections:
        inner = node.get(section)
        node[section] = inner = dict(inner) if isinstance(inner, dict) else {}
        node = inner
    node[last] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", required=True, help="the before tree's python")
    parser.add_argument("--before-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a gateway config key for the before server (repeatable)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per server")
    parser.add_argument("--concurrency", type=int, default=16)
    asyncio.run(_run(parser.parse_args()))


if __name__ == "__main__":
    main()
