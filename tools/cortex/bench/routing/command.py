"""``cortex bench routing``: cache hits and TTFT of Cortex against sglang-router, side by side.

For every workload (two Mooncake FAST'25 traces, llm-d's shared-prefix profile, multi-turn
agent sessions) and every contender (Cortex, Cortex with load-only routing,
``sglang-router`` cache_aware and round_robin), this starts the contender in front of fresh
``cortex sim`` workers with a finite KV pool and a prefill cost per uncached token, replays
the same request list on the same schedule, and checks that every request was sent, answered
and counted by the engines. It also computes what a single infinite cache would hit on the
same list. ``--out DIR`` gets ``report.md``, ``report.json`` and the plots.

The ``multimodal`` workload (vision-language conversations) runs on vLLM sims serving a
Qwen2.5-VL-shaped model (:mod:`cortex.bench.routing.vision`), the others on SGLang sims.

Beside the plain workloads it runs the deployment variants of
:mod:`cortex.bench.routing.scenarios` (router replicas behind HAProxy, churn, KV pressure,
real prompt sizes, prefill/decode pools), with ``vllm-router`` as a further contender.

Sizing (workers, KV pool, token and time scaling) is in :data:`FULL` and :data:`QUICK`; the
report states all of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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

from cortex.bench.report import package_version
from cortex.bench.routing.balancer import HAPROXY_INSTALL, haproxy_binary
from cortex.bench.routing.bounds import shape_prompts
from cortex.bench.routing.contenders import (
    CONTENDERS,
    OPT_IN,
    VARIANT_ONLY,
    SimSetup,
    cpu_split,
)
from cortex.bench.routing.real import REAL_CONTENDERS, REAL_MODELS, run_real, write_report
from cortex.bench.routing.report import WorkloadResult, report_json, report_markdown, write_plots
from cortex.bench.routing.runner import RunPlan, run_workload
from cortex.bench.routing.scenarios import VARIANTS, Variant
from cortex.bench.routing.text import BlockText, WordVocabulary
from cortex.bench.routing.vision import VisionPrompts, write_vision_model
from cortex.bench.routing.workloads import (
    AGENT_APIS,
    Workload,
    agent_sessions,
    load_trace,
    mooncake,
    multi_turn,
    multimodal,
    shared_prefix,
)
from cortex.hashing import Engine

__all__ = ["FULL", "PLAIN_WORKLOADS", "QUICK", "QUICK_WORKLOADS", "WORKLOADS", "EngineTokenizer",
           "Profile",
           "build_workloads", "load_chat_tokenizer", "register", "run"]

PLAIN_WORKLOADS = ("mooncake_conversation", "mooncake_synthetic", "shared_prefix",
                   "multi_turn", "mooncake_conversation_small_kv", *AGENT_APIS.values(),
                   "multimodal")
WORKLOADS = (*PLAIN_WORKLOADS, *VARIANTS)
"""The plain workloads, then the deployment variants (:mod:`cortex.bench.routing.scenarios`)."""
QUICK_WORKLOADS = ("shared_prefix", "multi_turn", "shared_prefix_r2", "churn", "pd")
QUICK_VARIANT_CONTENDERS = ("cortex", "sglang_cache_aware")
"""Who runs the variants in ``--quick`` (CI's smoke run stays under 2 minutes)."""
AGENT_API_OF = {name: endpoint for endpoint, name in AGENT_APIS.items()}
DEFAULT_CONTENDERS = ",".join(c for c in CONTENDERS if c not in OPT_IN)
TRACE_FILES = {"mooncake_conversation": "mooncake_conversation_trace.jsonl",
               "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
               "mooncake_conversation_small_kv": "mooncake_conversation_trace.jsonl"}


@dataclass(frozen=True, slots=True)
class Profile:
    """How big a run is. Token counts are in the benchmark's scaled tokens: one Mooncake
    512-token block is ``tokens_per_block`` tokens, and the llm-d / multi-turn sizes are
    divided by the same factor (512 / ``tokens_per_block``).

    Timing: ``prefill_ms_per_token`` per uncached benchmark token (0.2 ms = 12.5 us per real
    token, ~80k tokens/s: an 8B-class model on one H100) and ``decode_ms_per_token`` per
    output token. KV: each worker's pool is ``capacity_fraction`` of the workload's distinct
    prompt pages, except for the small-KV trace variant: ``small_kv_blocks`` blocks of 16
    tokens (2,048 = 32,768 benchmark tokens = 524,288 real ones, about the KV room of the
    same model on one 80 GB GPU at 128 KiB per token).

    Variants: the churn run is the shared-prefix prompts at a steady ``steady_rate`` req/s
    for ``steady_s`` seconds, each churn event measured over ``churn_window_s``; the
    real-size run replays ``real_trace_minutes`` of the conversation trace at
    ``real_trace_speedup`` with 512 tokens per Mooncake block.

    Agents: ``agent_sessions`` sessions on ``agent_prompts`` agent prompts, starting at
    ``agent_session_rate``/s, ``agent_turns`` turns each, ``agent_think_s`` between turns.

    Multimodal: ``mm_conversations`` conversations starting at ``mm_rate``/s,
    ``mm_rounds`` turns each, ``mm_think_s`` between turns, images drawn from
    ``mm_images`` distinct ones (Zipf 1), another image on a later turn with probability
    ``mm_new_image``, each worker's pool ``mm_capacity_fraction`` of its distinct pages.
    Image sizes (:data:`MM_SIDES`) are in pixels: 224 x 224 is 64 placeholder tokens, a
    ~1,000-token image at the 1/16 token scale."""

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
    repeats: int = 1
    capacity_fraction: float = 0.3
    small_kv_blocks: int = 2048
    prefill_ms_per_token: float = 0.2
    decode_ms_per_token: float = 5.0
    steady_rate: float = 12.0
    steady_s: float = 150.0
    churn_window_s: float = 60.0
    real_trace_minutes: float = 1.0
    real_trace_speedup: float = 4.0
    agent_prompts: int = 2
    agent_sessions: int = 24
    agent_turns: tuple[int, int] = (10, 40)
    agent_session_rate: float = 1.0
    agent_think_s: float = 1.0
    mm_conversations: int = 240
    mm_rounds: tuple[int, int] = (2, 5)
    mm_images: int = 96
    mm_rate: float = 8.0
    mm_think_s: float = 1.0
    mm_new_image: float = 0.25
    mm_capacity_fraction: float = 0.1

    @property
    def token_scale(self) -> float:
        return self.tokens_per_block / 512

    def scaled(self, real_tokens: int) -> int:
        return max(1, round(real_tokens * self.token_scale))


FULL = Profile(workers=8, tokens_per_block=32, trace_minutes=6, trace_speedup=8,
               shared_groups=64, shared_users=5, shared_rates=(4, 8, 16, 24, 32, 40, 48),
               shared_stage_s=6, multi_clients=48, multi_rounds=8, multi_client_rate=1.5,
               multi_think_s=1.0)
QUICK = Profile(workers=2, tokens_per_block=32, trace_minutes=0.15, trace_speedup=8,
                shared_groups=6, shared_users=3, shared_rates=(8, 16), shared_stage_s=1.0,
                multi_clients=5, multi_rounds=3, multi_client_rate=8.0, multi_think_s=0.2,
                steady_rate=8.0, steady_s=8.0, churn_window_s=3.0, real_trace_minutes=0.15,
                agent_prompts=1, agent_sessions=6, agent_turns=(10, 14), agent_session_rate=4.0,
                agent_think_s=0.2, mm_conversations=8, mm_rounds=(1, 3), mm_images=4,
                mm_rate=8.0, mm_think_s=0.2)

# the published sizes, in real tokens, scaled by Profile.scaled()
LLMD_SYSTEM, LLMD_QUESTION, LLMD_OUTPUT = 6000, 1200, 1000
MULTI_SYSTEM, MULTI_USER, MULTI_OUTPUT = 4096, 2048, 256
AGENT_SYSTEM, AGENT_TASK, AGENT_TOOL, AGENT_OUTPUT = (10_000, 30_000), 1000, 300, 200
MM_SYSTEM, MM_QUESTION, MM_OUTPUT = 2000, 200, 200
MM_SIDES = ((224, 224), (224, 280), (280, 280), (196, 252))
"""Image sizes (pixels) of the multimodal workload: 63-100 Qwen2.5-VL placeholder tokens."""


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "routing", help="cache hit rate and TTFT: Cortex vs sglang-router on real traces")
    parser.add_argument("--quick", action="store_true",
                        help="CI-sized smoke run (2 workers, tiny workloads, < 2 min)")
    parser.add_argument("--out", default="docs/bench/routing",
                        help="directory for report.md, report.json and the plots")
    parser.add_argument("--workloads",
                        help=f"comma list out of {', '.join(WORKLOADS)} (default: all; quick:"
                             " the first four)")
    parser.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                        help=f"comma list out of {', '.join(CONTENDERS)} (default: all but"
                             f" {', '.join(OPT_IN)})")
    parser.add_argument("--traces", default=None,
                        help="directory of the Mooncake traces (default: ../shared/data/traces"
                             " next to the repository)")
    parser.add_argument("--workers", type=int, help="sims per contender")
    parser.add_argument("--repeats", type=int,
                        help="runs per (workload, contender), contender order alternating")
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
    parser.add_argument("--delta", type=float,
                        help="Cortex routing weight delta (per uncached token being prefilled)")
    parser.add_argument("--session-weight", type=float,
                        help="Cortex routing weight session (per live agent session)")
    parser.add_argument("--kv-pressure", type=float,
                        help="Cortex routing weight kv_pressure (per uncached token on a full"
                             " KV pool)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per-request timeout")
    parser.add_argument("--quiet-wait-s", type=float,
                        help="before each run, wait up to this long for other work on the"
                             " machine to drop under 0.3 cores (default: 90 full, 0 quick)")
    parser.add_argument("--max-foreign-cores", type=float, default=0.6,
                        help="a run during which other work on the machine took more cores"
                             " than this is discarded and run once more (full mode)")
    parser.add_argument("--keep-logs", action="store_true", help="keep every process's log")
    parser.add_argument("--no-pin", action="store_true",
                        help="let every process use every core (default: each contender's"
                             " routing tier on the first CPU, workers and the load generator"
                             " on the others)")
    parser.add_argument("--real-engines", action="store_true",
                        help="two real vLLM engines instead of sims (make real-engines-setup);"
                             " contenders: " + ", ".join(REAL_CONTENDERS) + "; writes "
                             "real-<contender>.json and real-engines.md/.png to --out")
    parser.add_argument("--requests", type=int, default=150,
                        help="real engines: requests per contender")
    parser.add_argument("--conversations", type=int, default=32,
                        help="real engines: conversations the requests are drawn from")
    parser.add_argument("--replicas", type=int, default=1,
                        help="real engines: routers per contender (Cortex: gateways)")
    parser.add_argument("--clients", type=int, default=1,
                        help="real engines: clients sending at once, each with its own "
                             "conversations, one request at a time (default 1: sequential)")
    parser.add_argument("--real-model", default="model-qwen-slow", choices=REAL_MODELS,
                        help="real engines: the model directory the engines serve (default "
                             "model-qwen-slow, whose prefill shows in TTFT; model-qwen: the "
                             "suite's 2-layer model, whose TTFT is mostly the routing tier's)")
    parser.add_argument("--kv-blocks", type=int, default=512,
                        help="real engines: KV cache blocks (16 tokens) per engine; fewer "
                             "blocks, more eviction (at least 226: one engine must hold the "
                             "workload's longest prompt; the engines' context shrinks below "
                             "257)")
    parser.add_argument("--pin-engines", action="store_true",
                        help="real engines: each engine's processes on a core of their own "
                             "(engine i on core i; default: the OS places them)")
    parser.add_argument("--profile", action="store_true",
                        help="real engines: py-spy samples Cortex's gateway during its "
                             "workload; its top frames go into the report")
    parser.set_defaults(func=run)


def _run_real(args: argparse.Namespace) -> int:
    chosen = (",".join(REAL_CONTENDERS) if args.contenders == DEFAULT_CONTENDERS
              else args.contenders)
    _choice(chosen, REAL_CONTENDERS, "contenders")
    if args.clients < 1:
        raise SystemExit("bench routing --real-engines: --clients must be at least 1")
    contenders = [c.strip() for c in chosen.split(",") if c.strip()]  # run in the order given
    out = Path(args.out)
    repeats = args.repeats or 1
    quiet_wait_s = 60.0 if args.quiet_wait_s is None else args.quiet_wait_s
    run_real(out, contenders, requests=args.requests, conversations=args.conversations,
             replicas=args.replicas, seed=args.seed, profile=args.profile,
             model=args.real_model, kv_blocks=args.kv_blocks, repeats=repeats,
             quiet_wait_s=quiet_wait_s, max_foreign_cores=args.max_foreign_cores,
             clients=args.clients, pin_engines=args.pin_engines)
    command = ("cortex bench routing --real-engines --real-model "
               f"{args.real_model} --requests {args.requests} --conversations "
               f"{args.conversations} --replicas {args.replicas} --clients {args.clients} "
               "--kv-blocks "
               f"{args.kv_blocks} --repeats {repeats} --quiet-wait-s {quiet_wait_s:g} "
               f"--max-foreign-cores {args.max_foreign_cores:g} --contenders {','.join(contenders)}"
               f"{' --pin-engines' if args.pin_engines else ''}"
               f"{' --profile' if args.profile else ''}")
    print(f"report: {write_report(out, command)}")
    return 0


def _profile(args: argparse.Namespace) -> Profile:
    base = QUICK if args.quick else FULL
    overrides = {name: value for name, value in (
        ("workers", args.workers), ("repeats", args.repeats),
        ("trace_minutes", args.trace_minutes),
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
    root = Path(__file__).resolve().parents[4]
    return root.parent / "shared" / "data" / "traces"


def real_scale(profile: Profile) -> Profile:
    """``profile`` at real token counts (512 tokens per Mooncake block), on the shorter
    trace window of the real-size variant."""
    return dataclasses.replace(profile, tokens_per_block=512,
                               trace_minutes=profile.real_trace_minutes,
                               trace_speedup=profile.real_trace_speedup)


def build_workloads(profile: Profile, text: BlockText, names: Sequence[str], traces: Path,
                    seed: int, vision_text: BlockText | None = None) -> list[Workload]:
    """The selected workloads, in :data:`WORKLOADS` order; a variant is its base workload
    renamed (built at real token counts when the variant says so). ``vision_text``: the
    words of the multimodal workload's model (its tokenizer is not the default one)."""
    out: list[Workload] = []
    for name in names:
        if name == "multimodal":
            if vision_text is None:
                raise ValueError("the multimodal workload needs vision_text")
            out.append(multimodal(
                vision_text, conversations=profile.mm_conversations, rounds=profile.mm_rounds,
                images=profile.mm_images, sides=MM_SIDES, popularity=1.0,
                system_tokens=profile.scaled(MM_SYSTEM),
                question_tokens=profile.scaled(MM_QUESTION),
                output_tokens=profile.scaled(MM_OUTPUT), new_image=profile.mm_new_image,
                conversation_rate=profile.mm_rate, think_s=profile.mm_think_s,
                capacity_fraction=profile.mm_capacity_fraction, seed=seed))
        elif (variant := VARIANTS.get(name)) is not None:
            base_profile, base_text = profile, text
            if variant.real_tokens:
                base_profile = real_scale(profile)
                base_text = BlockText(text.vocabulary, 512, seed)
            base = build_workloads(base_profile, base_text, [variant.base], traces, seed)[0]
            out.append(dataclasses.replace(base, name=name,
                                           title=f"{base.title}: {variant.title}"))
        elif name in TRACE_FILES:
            path = traces / TRACE_FILES[name]
            kind = path.name.removeprefix("mooncake_").removesuffix("_trace.jsonl")
            small = name.endswith("_small_kv")
            workload = mooncake(
                load_trace(path, profile.trace_minutes), text, name=name,
                title=f"Mooncake {kind} trace" + (", small KV pools" if small else ""),
                source=f"Mooncake FAST'25 `{path.name}` (kvcache-ai/Mooncake FAST25-release),"
                       f" first {profile.trace_minutes:g} minutes"
                       + (f"; every worker's KV pool {profile.small_kv_blocks:,} blocks"
                          f" ({profile.small_kv_blocks * 16 * round(1 / profile.token_scale):,}"
                          " real tokens: an 8B-class model's KV room on one 80 GB GPU)"
                          if small else ""),
                speedup=profile.trace_speedup)
            out.append(dataclasses.replace(workload, kv_blocks=profile.small_kv_blocks)
                       if small else workload)
        elif name in ("shared_prefix", "shared_prefix_steady"):
            steady = name == "shared_prefix_steady"
            out.append(shared_prefix(
                text, groups=profile.shared_groups, users=profile.shared_users,
                system_tokens=profile.scaled(LLMD_SYSTEM),
                question_tokens=profile.scaled(LLMD_QUESTION),
                output_tokens=profile.scaled(LLMD_OUTPUT),
                rates=(profile.steady_rate,) if steady else profile.shared_rates,
                stage_s=profile.steady_s if steady else profile.shared_stage_s, seed=seed))
        elif name in AGENT_API_OF:
            out.append(agent_sessions(
                text, agents=profile.agent_prompts, sessions=profile.agent_sessions,
                turns=profile.agent_turns,
                system_tokens=(profile.scaled(AGENT_SYSTEM[0]), profile.scaled(AGENT_SYSTEM[1])),
                task_tokens=profile.scaled(AGENT_TASK), tool_tokens=profile.scaled(AGENT_TOOL),
                output_tokens=profile.scaled(AGENT_OUTPUT),
                session_rate=profile.agent_session_rate, think_s=profile.agent_think_s,
                seed=seed, endpoint=AGENT_API_OF[name]))
        elif name == "multi_turn":
            out.append(multi_turn(
                text, clients=profile.multi_clients, rounds=profile.multi_rounds,
                system_tokens=profile.scaled(MULTI_SYSTEM),
                user_tokens=profile.scaled(MULTI_USER),
                output_tokens=profile.scaled(MULTI_OUTPUT),
                client_rate=profile.multi_client_rate, think_s=profile.multi_think_s,
                seed=seed))
    return out


# ---- the whole benchmark ------------------------------------------------------------------------


def _variant_plan(plan: RunPlan, profile: Profile, variant: Variant | None) -> RunPlan:
    """The plan of one workload: at real token counts the sims' prefill cost is per real
    token (the same cost per real token as every other workload)."""
    if variant is None or not variant.real_tokens:
        return plan
    per_real = profile.prefill_ms_per_token * profile.token_scale
    return dataclasses.replace(plan, sims=dataclasses.replace(
        plan.sims, prefill_ms_per_token=per_real))


def _sized(variant: Variant | None, profile: Profile, quick: bool) -> Variant | None:
    """``variant`` with the profile's churn window (and the quick run's contenders)."""
    if variant is None:
        return None
    if quick:
        variant = dataclasses.replace(variant, contenders=tuple(
            c for c in variant.contenders
            if c in QUICK_VARIANT_CONTENDERS or c in VARIANT_ONLY))
    return dataclasses.replace(variant, window_s=profile.churn_window_s)


def cortex_weights(args: argparse.Namespace) -> dict[str, float]:
    """Cortex's routing weights: its documented defaults unless ``--alpha`` / ``--beta`` /
    ``--gamma`` / ``--delta`` override them (the report then says so)."""
    flags = {"alpha": "alpha", "beta": "beta", "gamma": "gamma", "delta": "delta",
             "session_weight": "session", "kv_pressure": "kv_pressure"}
    return {weight: float(v) for flag, weight in flags.items()
            if (v := getattr(args, flag, None)) is not None}


def run(args: argparse.Namespace) -> int:
    if args.real_engines:
        return _run_real(args)
    started = time.monotonic()
    profile = _profile(args)
    names = _choice(args.workloads or ",".join(QUICK_WORKLOADS if args.quick else WORKLOADS),
                    WORKLOADS, "workloads")
    contenders = _choice(args.contenders, CONTENDERS, "contenders")
    traces = _traces_dir(args.traces)
    if any(n in TRACE_FILES for n in names) and not traces.is_dir():
        raise SystemExit(f"no trace directory at {traces} (pass --traces DIR)")
    chat = load_chat_tokenizer()
    text = BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), profile.tokens_per_block,
                     args.seed)
    weights = cortex_weights(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="cortex-bench-routing-"))
    plan = RunPlan(
        SimSetup(workers=profile.workers, kv_capacity_blocks=1,
                 prefill_ms_per_token=profile.prefill_ms_per_token,
                 decode_ms_per_token=profile.decode_ms_per_token),
        tuple(contenders), profile.repeats, weights, logs, args.timeout_s,
        profile.capacity_fraction,
        quiet_wait_s=args.quiet_wait_s if args.quiet_wait_s is not None else (
            0.0 if args.quick else 90.0),
        max_foreign_cores=math.inf if args.quick else args.max_foreign_cores,
        noisy_retries=0 if args.quick else 1, idle_probes=3 if args.quick else 15,
        pin=not args.no_pin and cpu_split() is not None)
    results: list[WorkloadResult] = []
    ok = complete = False
    vision = _vision_setup(logs, plan, profile, args.seed) if "multimodal" in names else None
    try:
        for workload in build_workloads(profile, text, names, traces, args.seed,
                                        vision[1] if vision is not None else None):
            variant = VARIANTS.get(workload.name)
            if workload.name == "multimodal" and vision is not None:
                prompts, _, mm_plan = vision
                shapes = shape_prompts(workload.requests, prompts.encode_text,
                                       prompts.encode_chat, plan.sims.block_size,
                                       prompts.encode_media)
                results.append(run_workload(workload, shapes, mm_plan))
                continue
            shapes = shape_prompts(workload.requests, chat.encode_text, chat.encode_chat,
                                   plan.sims.block_size)
            results.append(run_workload(workload, shapes, _variant_plan(plan, profile, variant),
                                        variant=_sized(variant, profile, args.quick)))
        complete = True
        ok = all(r.verified for res in results for r in res.runs.values())
    finally:
        if args.keep_logs or not ok:
            print(f"process logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
        if results:  # an interrupted run still leaves what it measured
            config = _config(args, profile, weights, plan, time.monotonic() - started)
            config["complete"] = complete
            (out / "report.md").write_text(report_markdown(results, config), encoding="utf-8")
            (out / "report.json").write_text(
                json.dumps(report_json(results, config), indent=1) + "\n", encoding="utf-8")
            write_plots(results, out)
    print(f"report written to {out / 'report.md'} ({(time.monotonic() - started) / 60:.1f}"
          " min)", file=sys.stderr)
    return 0 if ok else 1


def _vision_setup(logs: Path, plan: RunPlan, profile: Profile, seed: int
                  ) -> tuple[VisionPrompts, BlockText, RunPlan]:
    """The multimodal workload's model directory (in ``logs``), its prompts, its words and
    its plan: vLLM sims serving that model (the gateway reads the same directory)."""
    model_dir = write_vision_model(logs / "model-qwen-vl")
    prompts = VisionPrompts(model_dir, plan.sims.model)
    text = BlockText(WordVocabulary.from_tokenizer(prompts.tokenizer), profile.tokens_per_block,
                     seed)
    sims = dataclasses.replace(plan.sims, engine=Engine.VLLM, model_dir=model_dir)
    return prompts, text, dataclasses.replace(plan, sims=sims)


def _config(args: argparse.Namespace, profile: Profile, weights: Mapping[str, float],
            plan: RunPlan, elapsed_s: float) -> dict[str, Any]:
    argv = ["cortex", "bench", "routing"] + (["--quick"] if args.quick else [])
    if args.workloads:
        argv += ["--workloads", args.workloads]
    if args.contenders != DEFAULT_CONTENDERS:
        argv += ["--contenders", args.contenders]
    for flag in ("workers", "repeats", "trace_minutes", "trace_speedup", "tokens_per_block",
                 "capacity_fraction", "prefill_ms_per_token", "alpha", "beta", "gamma", "delta",
                 "session_weight", "kv_pressure"):
        if (value := getattr(args, flag)) is not None:
            argv += [f"--{flag.replace('_', '-')}", f"{value:g}"]
    if args.seed:
        argv += ["--seed", str(args.seed)]
    if args.no_pin:
        argv.append("--no-pin")
    argv += ["--out", args.out]
    note = ("Cortex ran with its documented default routing weights (alpha 1 per cached"
            " token, beta 64 per running request, gamma 128 per queued request, delta 0.5 per"
            " uncached token being prefilled)."
            if not weights else
            f"Cortex ran with tuned routing weights {dict(weights)}, the others at their"
            " defaults (alpha 1, beta 64, gamma 128, delta 0.5).")
    sims = plan.sims
    return {
        "command": shlex.join(argv), "date": time.strftime("%Y-%m-%d"),
        "duration_min": elapsed_s / 60,
        "machine": f"{os.cpu_count()} cores ({platform.machine()}), Python"
                   f" {platform.python_version()}",
        "workers": sims.workers, "block_size": sims.block_size, "repeats": plan.repeats,
        "quiet_wait_s": plan.quiet_wait_s, "quiet_cores": plan.quiet_cores,
        "max_foreign_cores": None if math.isinf(plan.max_foreign_cores)
        else plan.max_foreign_cores, "noisy_retries": plan.noisy_retries,
        "prefill_ms_per_token": sims.prefill_ms_per_token,
        "prefill_overhead_ms": sims.prefill_overhead_ms,
        "decode_ms_per_token": sims.decode_ms_per_token, "max_running": sims.max_running,
        "sglang_router_version": package_version("sglang-router"),
        "vllm_router_version": package_version("vllm-router"),
        "haproxy": haproxy_binary() or f"not installed (`{HAPROXY_INSTALL}`)",
        "pinned": cpu_split() if plan.pin else None,
        "profile": dataclasses.asdict(profile), "cortex_weights": dict(weights),
        "cortex_weights_note": note, "seed": args.seed,
    }

