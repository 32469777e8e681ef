"""``cortex bench routing``: cache hits and TTFT of Cortex against sglang-router, side by side.

For every workload (two Mooncake FAST'25 traces, llm-d's shared-prefix profile, multi-turn
agent sessions) and every contender (Cortex, Cortex with load-only routing,
``sglang-router`` cache_aware and round_robin), this starts the contender in front of fresh
``cortex sim`` workers with a finite KV pool and a prefill cost per uncached token, replays
the same request list on the same schedule, and checks that every request was sent, answered
and counted by the engines. It also computes what a single infinite cache would hit on the
same list. ``--out DIR`` gets ``report.md``, ``report.json`` and the plots.

Sizing (workers, KV pool, token and time scaling) is in :data:`FULL` and :data:`QUICK`; the
report states all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex.bench.routing_bounds import (
    infinite_cache_hit_rate,
    nominal_order,
    pooled_lru_hit_rate,
    shape_prompts,
    unique_pages,
)
from cortex.bench.routing_client import drive, idle_ttft
from cortex.bench.routing_contenders import CONTENDERS, CpuMeter, Deployment, SimSetup, deploy
from cortex.bench.routing_metrics import EngineTotals, RunSummary, percentile, summarize
from cortex.bench.routing_report import (
    WorkloadResult,
    report_json,
    report_markdown,
    ttft_values_ms,
    write_plots,
)
from cortex.bench.routing_text import BlockText, WordVocabulary
from cortex.bench.routing_workloads import Workload, load_trace, mooncake, multi_turn, shared_prefix

__all__ = ["FULL", "QUICK", "WORKLOADS", "EngineTokenizer", "Profile", "build_workloads",
           "load_chat_tokenizer", "register", "run"]

WORKLOADS = ("mooncake_conversation", "mooncake_synthetic", "shared_prefix", "multi_turn")
TRACE_FILES = {"mooncake_conversation": "mooncake_conversation_trace.jsonl",
               "mooncake_synthetic": "mooncake_synthetic_trace.jsonl"}


@dataclass(frozen=True, slots=True)
class Profile:
    """How big a run is. Token counts are in the benchmark's scaled tokens: one Mooncake
    512-token block is ``tokens_per_block`` tokens, and the llm-d / multi-turn sizes are
    divided by the same factor (512 / ``tokens_per_block``)."""

    workers: int
    tokens_per_block: int
    trace_minutes: float
    trace_speedup: float
    shared_groups: int
    shared_users: int
    shared_rates: tuple[float, ...]
    shared_stage_s: float
    multi_clients: int
    multi_rounds: int
    multi_client_rate: float
    multi_think_s: float
    capacity_fraction: float = 0.3
    prefill_ms_per_token: float = 0.07
    decode_ms_per_token: float = 5.0

    @property
    def token_scale(self) -> float:
        return self.tokens_per_block / 512

    def scaled(self, real_tokens: int) -> int:
        return max(1, round(real_tokens * self.token_scale))


FULL = Profile(workers=4, tokens_per_block=32, trace_minutes=10, trace_speedup=12,
               shared_groups=64, shared_users=5, shared_rates=(4, 8, 16, 24, 32, 40, 48),
               shared_stage_s=6, multi_clients=64, multi_rounds=8, multi_client_rate=2.0,
               multi_think_s=1.0)
QUICK = Profile(workers=2, tokens_per_block=32, trace_minutes=0.5, trace_speedup=15,
                shared_groups=8, shared_users=3, shared_rates=(8, 16), shared_stage_s=1.5,
                multi_clients=6, multi_rounds=3, multi_client_rate=6.0, multi_think_s=0.2)

# the published sizes, in real tokens, scaled by Profile.scaled()
LLMD_SYSTEM, LLMD_QUESTION, LLMD_OUTPUT = 6000, 1200, 1000
MULTI_SYSTEM, MULTI_USER, MULTI_OUTPUT = 4096, 2048, 256


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "routing", help="cache hit rate and TTFT: Cortex vs sglang-router on real traces")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized smoke run (2 workers, tiny workloads, < 2 min)")
    parser.add_argument("--out", default="docs/bench/routing",
                        help="directory for report.md, report.json and the plots")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma list out of {', '.join(WORKLOADS)}")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma list out of {', '.join(CONTENDERS)}")
    parser.add_argument("--traces", default=None,
                        help="directory of the Mooncake traces (default: ../shared/data/traces"
                             " next to the repository)")
    parser.add_argument("--workers", type=int, help="sims per contender")
    parser.add_argument("--trace-minutes", type=float, help="replay the first N minutes")
    parser.add_argument("--trace-speedup", type=float, help="time compression of the traces")
    parser.add_argument("--tokens-per-block", type=int,
                        help="tokens per Mooncake 512-token block (sets the token scale)")
    parser.add_argument("--capacity-fraction", type=float,
                        help="each worker's KV pool as a fraction of the workload's working set")
    parser.add_argument("--prefill-ms-per-token", type=float,
                        help="sim cost per uncached prompt token (ms)")
    parser.add_argument("--alpha", type=float, help="Cortex routing weight alpha (per token)")
    parser.add_argument("--beta", type=float, help="Cortex routing weight beta (per running)")
    parser.add_argument("--gamma", type=float, help="Cortex routing weight gamma (per queued)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log")
    parser.set_defaults(func=run)


def _profile(args: argparse.Namespace) -> Profile:
    base = QUICK if args.quick else FULL
    overrides = {name: value for name, value in (
        ("workers", args.workers), ("trace_minutes", args.trace_minutes),
        ("trace_speedup", args.trace_speedup), ("tokens_per_block", args.tokens_per_block),
        ("capacity_fraction", args.capacity_fraction),
        ("prefill_ms_per_token", args.prefill_ms_per_token)) if value is not None}
    return dataclasses.replace(base, **overrides)


class EngineTokenizer:
    """The prompt token ids an SGLang sim computes for a request: its default tokenizer and
    chat template (the gateway's too), behind the two calls the benchmark needs."""

    def __init__(self) -> None:
        from cortex.chat import ChatTokenizer

        self._chat = ChatTokenizer.load()
        self.tokenizer = self._chat.tokenizer

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt."""
        ids: list[int] = self._chat.encode_text(text)
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """A chat request's messages, rendered the SGLang way."""
        from cortex.chat import RenderArgs
        from cortex.hashing import Engine

        ids: list[int] = self._chat.encode_chat(RenderArgs.of(Engine.SGLANG, messages))
        return ids

    def __repr__(self) -> str:
        return f"EngineTokenizer({self._chat!r})"


def load_chat_tokenizer() -> EngineTokenizer:
    """The sims' (and the gateway's) default tokenizer and chat template."""
    return EngineTokenizer()


def _choice(value: str, allowed: Sequence[str], what: str) -> list[str]:
    chosen = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in allowed]
    if unknown or not chosen:
        raise SystemExit(f"--{what}: unknown {unknown or 'empty list'}; choose from"
                         f" {', '.join(allowed)}")
    return [v for v in allowed if v in chosen]


def _traces_dir(value: str | None) -> Path:
    if value is not None:
        return Path(value)
    root = Path(__file__).resolve().parents[3]
    return root.parent / "shared" / "data" / "traces"


def build_workloads(profile: Profile, text: BlockText, names: Sequence[str], traces: Path,
                    seed: int) -> list[Workload]:
    """The selected workloads, in :data:`WORKLOADS` order."""
    out: list[Workload] = []
    for name in names:
        if name in TRACE_FILES:
            path = traces / TRACE_FILES[name]
            kind = name.removeprefix("mooncake_")
            out.append(mooncake(
                load_trace(path, profile.trace_minutes), text, name=name,
                title=f"Mooncake {kind} trace",
                source=f"Mooncake FAST'25 `{path.name}` (kvcache-ai/Mooncake FAST25-release),"
                       f" first {profile.trace_minutes:g} minutes",
                speedup=profile.trace_speedup))
        elif name == "shared_prefix":
            out.append(shared_prefix(
                text, groups=profile.shared_groups, users=profile.shared_users,
                system_tokens=profile.scaled(LLMD_SYSTEM),
                question_tokens=profile.scaled(LLMD_QUESTION),
                output_tokens=profile.scaled(LLMD_OUTPUT), rates=profile.shared_rates,
                stage_s=profile.shared_stage_s, seed=seed))
        elif name == "multi_turn":
            out.append(multi_turn(
                text, clients=profile.multi_clients, rounds=profile.multi_rounds,
                system_tokens=profile.scaled(MULTI_SYSTEM),
                user_tokens=profile.scaled(MULTI_USER),
                output_tokens=profile.scaled(MULTI_OUTPUT),
                client_rate=profile.multi_client_rate, think_s=profile.multi_think_s,
                seed=seed))
    return out


# ---- one run ----------------------------------------------------------------------------------


async def _sim_states(workers: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def one(url: str) -> dict[str, Any]:
            async with session.get(url + "/sim/state") as resp:
                resp.raise_for_status()
                state: dict[str, Any] = await resp.json()
                return state

        states = await asyncio.gather(*(one(url) for url in workers.values()))
    return dict(zip(workers, states, strict=True))


async def _settled(workers: Mapping[str, str], timeout_s: float = 15.0) -> dict[str, Any]:
    """Sim states once nothing runs or waits anywhere (bounded poll)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = await _sim_states(workers)
        if all(s["running"] == 0 and s["waiting"] == 0 for s in states.values()):
            return states
        if time.monotonic() > deadline:
            return states
        await asyncio.sleep(0.05)


def _totals(before: Mapping[str, Any], after: Mapping[str, Any]) -> dict[str, EngineTotals]:
    out = {}
    for wid, state in after.items():
        s0, s1 = before[wid]["stats"], state["stats"]
        out[wid] = EngineTotals(
            requests=s1["requests_finished"] - s0["requests_finished"],
            prompt_tokens=s1["prompt_tokens"] - s0["prompt_tokens"],
            cached_tokens=s1["cached_tokens"] - s0["cached_tokens"],
            evicted_blocks=state["cache"]["evicted_blocks"]
            - before[wid]["cache"]["evicted_blocks"])
    return out


async def _measure(d: Deployment, workload: Workload, model: str, expected_prompt: list[int],
                   timeout_s: float) -> tuple[RunSummary, list[float]]:
    idle = await idle_ttft(d.url, model)
    before = await _settled(d.workers)
    meter = CpuMeter(d.pids)

    def progress(done: int, total: int) -> None:
        if done % max(total // 4, 1) == 0:
            print(f"    {done}/{total}", file=sys.stderr, flush=True)

    outcomes = await drive(workload, d.url, model, timeout_s=timeout_s, progress=progress)
    cpu = meter.stop()
    after = await _settled(d.workers)
    reqs = workload.requests
    summary = summarize(
        workload.name, d.contender, outcomes, [r.digest() for r in reqs], expected_prompt,
        [r.max_tokens for r in reqs], _totals(before, after),
        stage_of=[r.stage for r in reqs], stage_rates=workload.stages,
        extra={"idle_ttft_p50_ms": round(percentile(idle, 50) * 1e3, 2) if idle else None,
               "cpu": cpu, "startup_s": round(d.startup_s, 2), "deployment": d.description})
    return summary, ttft_values_ms([o.ttft_s for o in outcomes if o.ok])


# ---- the whole benchmark ------------------------------------------------------------------------


def _capacity(profile: Profile, pages: int, max_request_pages: int) -> int:
    """Each worker's KV pool: ``capacity_fraction`` of the working set, but room for a few
    of the largest requests at once."""
    return max(math.ceil(profile.capacity_fraction * pages), 4 * max_request_pages, 256)


def _weights(args: argparse.Namespace) -> dict[str, float]:
    return {k: float(v) for k in ("alpha", "beta", "gamma")
            if (v := getattr(args, k)) is not None}


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()
    profile = _profile(args)
    names = _choice(args.workloads, WORKLOADS, "workloads")
    contenders = _choice(args.contenders, CONTENDERS, "contenders")
    traces = _traces_dir(args.traces)
    if any(n in TRACE_FILES for n in names) and not traces.is_dir():
        raise SystemExit(f"no trace directory at {traces} (pass --traces DIR)")
    chat = load_chat_tokenizer()
    text = BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), profile.tokens_per_block,
                     args.seed)
    weights = _weights(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="cortex-bench-routing-"))
    results: list[WorkloadResult] = []
    ok = False
    try:
        for workload in build_workloads(profile, text, names, traces, args.seed):
            results.append(_run_workload(workload, profile, chat, contenders, weights, logs,
                                         args.timeout_s))
        ok = all(r.verified for res in results for r in res.runs.values())
    finally:
        if args.keep_logs or not ok:
            print(f"process logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
    config = _config(args, profile, weights, time.monotonic() - started)
    (out / "report.md").write_text(report_markdown(results, config), encoding="utf-8")
    import json

    (out / "report.json").write_text(json.dumps(report_json(results, config), indent=1) + "\n",
                                     encoding="utf-8")
    write_plots(results, out)
    print(f"report written to {out / 'report.md'} ({config['duration_min']:.1f} min)",
          file=sys.stderr)
    return 0 if ok else 1


def _run_workload(workload: Workload, profile: Profile, chat: EngineTokenizer,
                  contenders: Sequence[str], weights: Mapping[str, float], logs: Path,
                  timeout_s: float) -> WorkloadResult:
    setup0 = SimSetup(workers=profile.workers, kv_capacity_blocks=1,
                      prefill_ms_per_token=profile.prefill_ms_per_token,
                      decode_ms_per_token=profile.decode_ms_per_token)
    page = setup0.block_size
    shapes = shape_prompts(workload.requests, chat.encode_text, chat.encode_chat, page)
    order = nominal_order(workload)
    pages = unique_pages(shapes)
    largest = max(s.tokens + r.max_tokens for s, r in zip(shapes, workload.requests,
                                                          strict=True))
    capacity = _capacity(profile, pages, -(-largest // page))
    setup = dataclasses.replace(setup0, kv_capacity_blocks=capacity)
    prompt_tokens = sum(s.tokens for s in shapes)
    nominal = {r.id: r.at_s for r in workload.requests}
    for r in workload.requests:
        if r.after is not None:
            nominal[r.id] = nominal[r.after] + r.at_s
    span = max(nominal.values(), default=0.0) or 1.0
    offered = (prompt_tokens * profile.prefill_ms_per_token / 1e3) / (span * profile.workers)
    res = WorkloadResult(
        workload, prompt_tokens,
        infinite_cache_hit_rate(shapes, order, page),
        pooled_lru_hit_rate(shapes, order, page, capacity * profile.workers),
        pages, capacity, offered)
    print(f"{workload.name}: {len(workload.requests)} requests, bound"
          f" {res.infinite_bound:.1%}, pooled LRU {res.pooled_bound:.1%}, {capacity} blocks"
          f" per worker, offered prefill load {offered:.0%}", file=sys.stderr, flush=True)
    expected = [s.tokens for s in shapes]
    for contender in contenders:
        with deploy(contender, setup, logs / workload.name / contender, weights) as d:
            summary, ttfts = asyncio.run(_measure(d, workload, setup.model, expected,
                                                  timeout_s))
        res.runs[contender] = summary
        res.ttfts_ms[contender] = ttfts
        t = summary.ttft_ms
        print(f"  {contender}: {summary.requests_ok}/{summary.requests_expected} ok, hit"
              f" {summary.hit_rate:.1%}, TTFT p50/p90/p99 {t[0]:.1f}/{t[1]:.1f}/{t[2]:.1f} ms,"
              f" {summary.throughput_rps:.1f} req/s"
              + ("" if summary.verified else f"  NOT VERIFIED: {summary.problems}"),
              file=sys.stderr, flush=True)
    return res


def _config(args: argparse.Namespace, profile: Profile, weights: Mapping[str, float],
            elapsed_s: float) -> dict[str, Any]:
    argv = ["cortex", "bench", "routing"] + (["--quick"] if args.quick else [])
    for flag in ("workloads", "contenders"):
        default = ",".join(WORKLOADS if flag == "workloads" else CONTENDERS)
        if getattr(args, flag) != default:
            argv += [f"--{flag}", getattr(args, flag)]
    for flag in ("workers", "trace_minutes", "trace_speedup", "tokens_per_block",
                 "capacity_fraction", "prefill_ms_per_token", "alpha", "beta", "gamma"):
        if (value := getattr(args, flag)) is not None:
            argv += [f"--{flag.replace('_', '-')}", f"{value:g}"]
    if args.seed:
        argv += ["--seed", str(args.seed)]
    argv += ["--out", args.out]
    note = (f"Cortex ran with routing weights {dict(weights)} (the rest at their defaults)."
            if weights else "Cortex ran with its documented default routing weights"
            " (alpha 1, beta 64, gamma 128).")
    return {
        "command": shlex.join(argv), "date": time.strftime("%Y-%m-%d"),
        "duration_min": elapsed_s / 60,
        "machine": f"{os.cpu_count()} cores ({platform.machine()}), Python"
                   f" {platform.python_version()}",
        "workers": profile.workers, "block_size": 16,
        "prefill_ms_per_token": profile.prefill_ms_per_token, "prefill_overhead_ms": 2.0,
        "decode_ms_per_token": profile.decode_ms_per_token,
        "profile": dataclasses.asdict(profile), "cortex_weights": dict(weights),
        "cortex_weights_note": note, "seed": args.seed,
    }
