"""``cortex bench capacity``: CPU per request and per ledger update of every Cortex service.

The inputs of the capacity model in ``docs/scaling.md``. One local cluster (Redis, index,
ingest, two gateways, zero-cost sims) serves chat requests of several prompt sizes, each a
shared system prompt (``--prefix-share`` of the tokens, one of ``--groups``) plus a unique
user turn, all sent to *gateway-0*. Both gateways hold a live replica of the ledger and
apply every update; gateway-1 gets no request, so its CPU above its idle baseline is what
applying the updates costs a gateway, and gateway-0's CPU above gateway-1's is what the
requests cost. Index and ingest CPU above their idle baselines are per ledger update
(blocks stored + blocks evicted, from the sims' counters). CPU comes from ``/proc`` (user
+ system time of each process); the sims' own CPU is not counted.

The same sizes run a second time with ``index.replica = false`` (*rpc* mode): the gateways
keep no replica and ask the index over gRPC for every request, so the index's CPU per
request is the Match path's cost, and gateways no longer pay for updates.

Writes ``report.md``, ``report.json`` and ``cpu_per_request.png`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex.bench import pyspy
from cortex.bench.report import table
from cortex.bench.routing.contenders import CpuMeter
from cortex.bench.routing.text import BlockText, Segment, WordVocabulary
from cortex.devcluster.cluster import ClusterSpec, LocalCluster

__all__ = ["SizeResult", "fit_line", "register", "run"]

SERVICES = ("gateway-0", "gateway-1", "index", "ingest", "redis")
UPDATE_COSTS = ("gateway-1", "index", "ingest", "redis")
PIPELINE = ("ingest", "index", "redis")  # the ledger pipeline behind the gateways
BLOCK_SIZE = 16


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "capacity", help="CPU per request and per ledger update of gateway, index, ingest")
    parser.add_argument("--sizes", default="1024,2048,4096,8192,16384",
                        help="prompt sizes in tokens, comma separated")
    parser.add_argument("--requests", type=int, default=120, help="requests per size")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="requests/s, open loop (0: --concurrency in flight, as fast as"
                             " they go)")
    parser.add_argument("--turns", type=int, default=1,
                        help="turns per conversation (> 1: multi-turn chat, the history"
                             " resent each turn)")
    parser.add_argument("--profile", action="store_true",
                        help="sample ingest and index with py-spy while requests run (top"
                             " frames in the report)")
    parser.add_argument("--py-spy", default="", help="py-spy executable (default: on PATH)")
    parser.add_argument("--prefix-share", type=float, default=0.6,
                        help="fraction of each prompt that is its group's shared prefix")
    parser.add_argument("--groups", type=int, default=8, help="shared prefixes per size")
    parser.add_argument("--workers", type=int, default=4, help="zero-cost sims")
    parser.add_argument("--kv-blocks", type=int, default=65_536,
                        help="each sim's KV pool (blocks of 16 tokens); evictions are updates")
    parser.add_argument("--idle-s", type=float, default=3.0,
                        help="idle interval measuring each process's baseline (s)")
    parser.add_argument("--modes", default="replica,rpc",
                        help="replica (ledger replica in every gateway), rpc (Match over"
                             " gRPC per request), or both")
    parser.add_argument("--out", default="docs/bench/capacity", help="report directory")
    parser.set_defaults(func=run)


@dataclass(frozen=True, slots=True)
class SizeResult:
    """One prompt size in one mode: requests, wall time (s), CPU seconds per process above
    its idle baseline, and the ledger updates (blocks) the run caused."""

    mode: str
    prompt_tokens: int
    requests: int
    errors: int
    wall_s: float
    cpu_s: Mapping[str, float]
    stored_blocks: int
    evicted_blocks: int

    @property
    def updates(self) -> int:
        return self.stored_blocks + self.evicted_blocks

    def per_request_ms(self, process: str) -> float:
        return self.cpu_s[process] / self.requests * 1e3 if self.requests else 0.0

    @property
    def request_path_ms(self) -> float:
        """Gateway CPU per request on the request path (gateway-0 minus gateway-1), ms."""
        if not self.requests:
            return 0.0
        return (self.cpu_s["gateway-0"] - self.cpu_s["gateway-1"]) / self.requests * 1e3

    def per_update_us(self, process: str) -> float:
        return self.cpu_s[process] / self.updates * 1e6 if self.updates else 0.0


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x``; ``(a, b)``."""
    n = len(xs)
    if n < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0
    return my - b * mx, b


def _prompts(text: BlockText, size: int, requests: int, share: float, groups: int,
             first_block: int, turns: int = 1) -> list[list[dict[str, str]]]:
    """Chat messages: a group's system prompt (``share`` of ``size`` tokens) + a unique
    user turn; fresh block ids from ``first_block`` on so sizes never share a prefix.

    With ``turns`` > 1 the requests are conversations of that many turns, interleaved
    (request ``i`` is turn ``i // conversations`` of conversation ``i % conversations``):
    each turn repeats the conversation so far, a short assistant answer and a new user turn
    of the same size (a multi-turn chat: the history is a cached prefix)."""
    b = text.tokens_per_block
    shared = max(b, round(size * share))
    own = max(b, size - shared)
    next_id = first_block
    systems = []
    for _ in range(groups):
        blocks = tuple(range(next_id, next_id + -(-shared // b)))
        next_id += len(blocks)
        systems.append(text.text(Segment(blocks, shared)))
    conversations = max(1, -(-requests // max(1, turns)))
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": systems[c % groups]}] for c in range(conversations)]
    out = []
    for i in range(requests):
        history = histories[i % conversations]
        if len(history) > 1:  # the previous turn's answer
            blocks = (next_id,)
            next_id += 1
            history.append({"role": "assistant", "content": text.text(Segment(blocks, b))})
        blocks = tuple(range(next_id, next_id + -(-own // b)))
        next_id += len(blocks)
        history.append({"role": "user", "content": text.text(Segment(blocks, own))})
        out.append(list(history))
    return out


async def _drive(url: str, model: str, prompts: Sequence[list[dict[str, str]]],
                 concurrency: int, rate: float = 0.0) -> int:
    """Send every prompt (``concurrency`` at a time, or with ``rate`` > 0 one every
    ``1 / rate`` s whatever is in flight: an ordinary open-loop load); the number that
    failed."""
    errors = 0
    queue = list(reversed(prompts))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def send(messages: list[dict[str, str]]) -> None:
            nonlocal errors
            body = {"model": model, "messages": messages, "max_tokens": 4,
                    "ignore_eos": True}
            try:
                async with session.post(url + "/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    errors += resp.status != 200
            except (aiohttp.ClientError, TimeoutError):
                errors += 1

        async def client() -> None:
            while queue:
                await send(queue.pop())

        if rate <= 0:
            await asyncio.gather(*(client() for _ in range(concurrency)))
            return errors
        started = time.perf_counter()
        tasks = []
        for i, messages in enumerate(prompts):
            await asyncio.sleep(max(0.0, started + i / rate - time.perf_counter()))
            tasks.append(asyncio.create_task(send(messages)))
        await asyncio.gather(*tasks)
    return errors


async def _cache_counters(urls: Sequence[str]) -> tuple[int, int]:
    """Σ cached blocks and Σ evicted blocks over the sims."""
    cached = evicted = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for url in urls:
            async with session.get(url + "/sim/state") as resp:
                cache = (await resp.json())["cache"]
                cached += int(cache["cached_blocks"])
                evicted += int(cache["evicted_blocks"])
    return cached, evicted


def _idle_cores(pids: Mapping[str, int], seconds: float) -> dict[str, float]:
    meter = CpuMeter(pids)
    time.sleep(seconds)
    measured = meter.stop()
    return {name: measured["processes"][name] / measured["wall_s"] for name in pids}


def _measure(cluster: LocalCluster, mode: str, text: BlockText, size: int,
             args: argparse.Namespace, first_block: int) -> SizeResult:
    pids = {name: cluster.process(name).pid for name in SERVICES}
    urls = [w.url for w in cluster.workers.values()]
    prompts = _prompts(text, size, args.requests, args.prefix_share, args.groups, first_block,
                       args.turns)
    idle_before = _idle_cores(pids, args.idle_s)
    cached0, evicted0 = asyncio.run(_cache_counters(urls))
    spies = []
    if args.profile:  # the ledger pipeline, over the whole drive (its expected length)
        seconds = len(prompts) / args.rate if args.rate else 30.0
        spies = [pyspy.record(pyspy.find_py_spy(args.py_spy), pids[name], seconds,
                              Path(args.out) / f"profile-{mode}-{size}-{name}.txt")
                 for name in ("ingest", "index")]
    meter = CpuMeter(pids)
    errors = asyncio.run(_drive(cluster.gateway_urls[0], cluster.spec.model, prompts,
                                args.concurrency, args.rate))
    measured = meter.stop()
    for spy in spies:
        spy.wait(60)
    cached1, evicted1 = asyncio.run(_cache_counters(urls))
    # a process's baseline is the lower of its idle draws before and after the drive: the
    # one before can still hold start-up work (a gateway's encoder warm-up and parity
    # probe take seconds of CPU), which would be subtracted from the requests' cost
    idle_after = _idle_cores(pids, args.idle_s)
    idle = {name: min(idle_before[name], idle_after[name]) for name in pids}
    wall = measured["wall_s"]
    cpu = {name: max(measured["processes"][name] - idle[name] * wall, 0.0) for name in pids}
    evicted = evicted1 - evicted0
    return SizeResult(mode, size, len(prompts) - errors, errors, wall, cpu,
                      cached1 - cached0 + evicted, evicted)


def run(args: argparse.Namespace) -> int:
    from cortex.chat import ChatTokenizer

    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    tokenizer = ChatTokenizer.load().tokenizer
    text = BlockText(WordVocabulary.from_tokenizer(tokenizer), 512)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in ("replica", "rpc") if m in args.modes.split(",")]
    started = time.monotonic()
    results: list[SizeResult] = []
    for mode in modes:
        spec = ClusterSpec(workers=args.workers, gateways=2, port=0, zero_cost=True,
                           block_size=BLOCK_SIZE, kv_capacity_blocks=args.kv_blocks,
                           gateway_config={"index": {"replica": mode == "replica"}})
        with tempfile.TemporaryDirectory(prefix="cortex-bench-capacity-") as logs, \
                LocalCluster(spec, logs) as cluster:
            first_block = 0
            for size in sizes:
                res = _measure(cluster, mode, text, size, args, first_block)
                first_block += size * (args.requests + args.groups)
                results.append(res)
                print(f"{mode}, {size} tokens: {res.requests} ok ({res.errors} failed) in"
                      f" {res.wall_s:.1f} s; gateway request path {res.request_path_ms:.2f}"
                      f" ms/request, index {res.per_request_ms('index'):.2f} ms/request,"
                      f" updates {res.updates:,} (gateway-1"
                      f" {res.per_update_us('gateway-1'):.2f} µs, index"
                      f" {res.per_update_us('index'):.2f} µs, ingest"
                      f" {res.per_update_us('ingest'):.2f} µs per update)", file=sys.stderr)
    config = {"command": "cortex bench capacity " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if k not in ("func", "command", "benchmark", "py_spy") and v not in (None, False)),
        "date": time.strftime("%Y-%m-%d"), "minutes": (time.monotonic() - started) / 60,
        "machine": f"{os.cpu_count()} cores ({platform.machine()}), Python"
                   f" {platform.python_version()}",
        "workers": args.workers, "concurrency": args.concurrency, "rate": args.rate,
        "turns": args.turns,
        "prefix_share": args.prefix_share, "groups": args.groups,
        "kv_blocks": args.kv_blocks, "block_size": BLOCK_SIZE}
    doc = report_json(results, config)
    (out / "report.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "report.md").write_text(report_markdown(doc) + _profiles(out), encoding="utf-8")
    _plot(results, out / "cpu_per_request.png")
    print(f"report written to {out / 'report.md'}", file=sys.stderr)
    return 0 if all(r.errors == 0 for r in results) else 1


def _fit(results: Sequence[SizeResult], per_request: Callable[[SizeResult], float]
         ) -> dict[str, float]:
    a, b = fit_line([r.prompt_tokens for r in results], [per_request(r) for r in results])
    return {"intercept": round(a, 4), "per_1k_tokens": round(b * 1e3, 4)}


def _update_fit(runs: Sequence[SizeResult], process: str) -> dict[str, float]:
    """``process``'s CPU per request (µs) as a fixed part (one update batch) plus a part
    per update: ``per_request + per_update · updates``."""
    a, b = fit_line([r.updates / r.requests for r in runs if r.requests],
                    [r.cpu_s[process] / r.requests * 1e6 for r in runs if r.requests])
    return {"per_request": round(a, 1), "per_update": round(b, 3)}


def report_json(results: Sequence[SizeResult], config: Mapping[str, Any]) -> dict[str, Any]:
    """Every size's numbers; per mode the mean cost of an update (replica mode) and line
    fits of the gateway's request path and (rpc mode) the index's CPU per request."""
    modes: dict[str, Any] = {}
    for mode in dict.fromkeys(r.mode for r in results):
        runs = [r for r in results if r.mode == mode]
        updates = sum(r.updates for r in runs)
        modes[mode] = {
            "us_per_update": {p: round(sum(r.cpu_s[p] for r in runs) / updates * 1e6, 3)
                              if updates else 0.0 for p in UPDATE_COSTS},
            "request_path_fit_ms": _fit(runs, lambda r: r.request_path_ms),
            "index_fit_ms": _fit(runs, lambda r: r.per_request_ms("index")),
            "update_fit_us": {p: _update_fit(runs, p) for p in UPDATE_COSTS[:3]}}
    return {
        "sizes": [{**asdict(r), "updates": r.updates,
                   "gateway_request_path_ms": round(r.request_path_ms, 3),
                   "gateway0_ms_per_request": round(r.per_request_ms("gateway-0"), 3),
                   "index_ms_per_request": round(r.per_request_ms("index"), 3),
                   "pipeline_ms_per_request": round(sum(
                       r.per_request_ms(p) for p in PIPELINE), 3),
                   "updates_per_request": round(r.updates / r.requests, 1) if r.requests else 0,
                   "us_per_update": {p: round(r.per_update_us(p), 3) for p in UPDATE_COSTS}}
                  for r in results],
        "modes": modes,
        "config": dict(config),
    }


def report_markdown(doc: Mapping[str, Any]) -> str:
    cfg = doc["config"]
    lines = [
        "# CPU per request and per ledger update (`cortex bench capacity`)", "",
        f"`{cfg['command']}` — {cfg['date']}, {cfg['minutes']:.1f} min on {cfg['machine']}.",
        "",
        f"One cluster: Redis, index, ingest, two gateways, {cfg['workers']} zero-cost SGLang"
        f" sims (page {cfg['block_size']} tokens, {cfg['kv_blocks']:,} blocks each). Chat"
        f" requests, {_load(cfg)}, each a shared system prompt"
        f" ({cfg['prefix_share']:.0%} of its tokens, {cfg['groups']} groups) and a unique user"
        " turn, all to gateway-0. *replica* mode: both gateways apply every ledger update to"
        " their replica; gateway-1 serves nothing, so its CPU is the update cost, and"
        " gateway-0 minus gateway-1 is the request path (parse, template, tokenize, keys,"
        " match, score, proxy the answer). *rpc* mode (`index.replica = false`): no replica,"
        " one gRPC Match per request, so the index's CPU per request is the Match path. Every"
        " CPU figure is above the process's own idle baseline (health probes, lease renewal,"
        " polling). Updates = blocks stored + blocks evicted.", "",
        *table(("mode", "prompt tokens", "requests", "gateway request path ms CPU / request",
                "index ms / request", "ingest + index + Redis ms / request",
                "updates / request",
                "µs per update: gateway replica · index · ingest · Redis"),
               [(s["mode"], f"{s['prompt_tokens']:,}", s["requests"],
                 f"{s['gateway_request_path_ms']:.2f}", f"{s['index_ms_per_request']:.2f}",
                 f"{s['pipeline_ms_per_request']:.2f}",
                 f"{s['updates_per_request']:,.0f}",
                 " · ".join(f"{s['us_per_update'][p]:.2f}"
                            for p in ("gateway-1", "index", "ingest", "redis")))
                for s in doc["sizes"]]),
        ""]
    for mode, m in doc["modes"].items():
        fit, upd, idx = m["request_path_fit_ms"], m["us_per_update"], m["index_fit_ms"]
        lines.append(
            f"- {mode}: gateway request path **{fit['intercept']:.2f} ms +"
            f" {fit['per_1k_tokens']:.3f} ms per 1k prompt tokens** of CPU per request; index"
            f" {idx['intercept']:.2f} ms + {idx['per_1k_tokens']:.3f} ms per 1k tokens per"
            f" request; one ledger update costs the gateway replica {upd['gateway-1']:.2f} µs,"
            f" the index {upd['index']:.2f} µs, ingest {upd['ingest']:.2f} µs, Redis"
            f" {upd['redis']:.2f} µs. As a fixed part per request (its update batch) plus"
            " a part per update: " + "; ".join(
                f"{'gateway replica' if p == 'gateway-1' else p} {f['per_request']:.0f} µs +"
                f" {f['per_update']:.2f} µs · updates" for p, f in m["update_fit_us"].items())
            + ".")
    lines += ["", "![CPU per request](cpu_per_request.png)", "",
              "How these numbers become a cluster size: [../../scaling.md](../../scaling.md).",
              ""]
    return "\n".join(lines)


def _profiles(out: Path) -> str:
    """The top frames of every profile the run recorded (``--profile``)."""
    lines: list[str] = []
    for raw in sorted(out.glob("profile-*.txt")):
        mode, size, name = raw.stem.split("-")[1:4]
        lines += [f"## Where the {name}'s time goes ({mode}, {int(size):,}-token prompts,"
                  " py-spy)", "", *pyspy.top_frames_table(raw), ""]
    return "\n".join(lines)


def _load(cfg: Mapping[str, Any]) -> str:
    """How the requests were sent, in words."""
    turns = cfg.get("turns", 1)
    load = (f"{cfg['rate']:g} req/s open loop" if cfg.get("rate")
            else f"{cfg['concurrency']} in flight")
    return load + (f", conversations of {turns} turns (history resent)" if turns > 1 else "")


def _plot(results: Sequence[SizeResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, style in (("replica", "-"), ("rpc", "--")):
        runs = [r for r in results if r.mode == mode]
        if not runs:
            continue
        xs = [r.prompt_tokens for r in runs]
        ax1.plot(xs, [r.request_path_ms for r in runs], "o" + style,
                 label=f"gateway request path ({mode})")
        ax1.plot(xs, [r.per_request_ms("index") for r in runs], "s" + style,
                 label=f"index ({mode})")
        for process in ("gateway-1", "index", "ingest"):
            name = "gateway replica" if process == "gateway-1" else process
            ax2.plot(xs, [r.per_update_us(process) for r in runs], "o" + style,
                     label=f"{name} ({mode})")
    ax1.set_xlabel("prompt tokens")
    ax1.set_ylabel("CPU ms per request")
    ax2.set_xlabel("prompt tokens")
    ax2.set_ylabel("CPU µs per ledger update")
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
