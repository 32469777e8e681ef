"""The routing benchmark's workloads: fixed request lists, deterministic given a seed (pure).

Three families, each described by where it comes from and how it was scaled to one machine:

* :func:`mooncake` — a Mooncake FAST'25 trace: real arrival times and 512-token prefix-block
  ids. Each block id becomes ``tokens_per_block`` tokens (:mod:`cortex.bench.routing.text`),
  input and output lengths shrink by ``tokens_per_block / 512``, the first ``minutes`` of
  the trace are replayed ``speedup`` times faster.
* :func:`shared_prefix` — llm-d's published shared-prefix profile (``inference-perf``
  ``shared_prefix``: G groups x U users, one long system prompt per group plus a unique
  question, the prompt list shuffled and cycled, Poisson arrivals at a ladder of rates).
* :func:`multi_turn` — the agent pattern of SGLang's ``bench_multiturn``: clients whose
  history grows round by round (a shared system prompt, then user turn, answer, user turn…).
* :func:`agent_sessions` — coding-agent sessions (issue 29): a long shared system prompt and
  tool schema, many short turns (tool results) with think time, sessions in parallel, each
  naming its session in a header.
* :func:`multimodal` — vision-language conversations (issue 31): a shared system prompt, then
  an image and a question; popular images come back in new conversations, later turns ask
  about the same image again or add another one.

A :class:`Request` is sent at ``at_s`` after the run starts, or — when ``after`` names an
earlier request — ``at_s`` after that request completed (a client's think time).
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import random
import struct
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from cortex.bench.routing.text import BlockText, Segment

__all__ = [
    "AGENT_APIS",
    "SESSION_HEADER",
    "TRACE_BLOCK_TOKENS",
    "Endpoint",
    "Request",
    "TraceRow",
    "Workload",
    "agent_sessions",
    "load_trace",
    "mooncake",
    "multi_turn",
    "multimodal",
    "png_data_url",
    "poisson_ladder",
    "shared_prefix",
]

TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""

SESSION_HEADER = "x-session-id"
"""The header an agent session's requests carry (Cortex honours it, and so does
``vllm-router --policy consistent_hash``)."""


class Endpoint(StrEnum):
    """Which API a request goes to: OpenAI completions or chat, Anthropic Messages, or
    stateless OpenAI Responses (the last three carry the same messages: an engine converts
    a Messages / Responses request to that chat, so the prompt tokens are the same)."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    MESSAGES = "messages"
    RESPONSES = "responses"

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS = {Endpoint.COMPLETIONS: "/v1/completions", Endpoint.CHAT: "/v1/chat/completions",
          Endpoint.MESSAGES: "/v1/messages", Endpoint.RESPONSES: "/v1/responses"}


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a workload.

    ``prompt`` (completions) or ``messages`` (chat); ``max_tokens`` output tokens, always
    generated in full (``ignore_eos``). ``at_s``: seconds after the run started, or after
    request ``after`` completed. ``stage``: the rate-ladder step (0 when there is none);
    ``conversation`` / ``turn`` for multi-turn clients. ``images``: ``(message index,
    image URL)`` pairs, each sent as an ``image_url`` part before that message's text.
    """

    id: int
    endpoint: Endpoint
    max_tokens: int
    at_s: float
    prompt: str | None = None
    messages: tuple[tuple[str, str], ...] = ()
    after: int | None = None
    stage: int = 0
    conversation: int | None = None
    turn: int = 0
    session: str | None = None
    images: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if (self.prompt is None) == (not self.messages):
            raise ValueError("a request has either a prompt or messages")
        if any(not 0 <= i < len(self.messages) for i, _ in self.images):
            raise ValueError("an image belongs to one of the request's messages")
        if self.images and self.endpoint is not Endpoint.CHAT:
            raise ValueError("images are sent with chat requests only")
        if (self.prompt is None) != (self.endpoint is not Endpoint.COMPLETIONS):
            raise ValueError("completions take a prompt, the other APIs take messages")
        if self.max_tokens < 1 or self.at_s < 0:
            raise ValueError("max_tokens must be >= 1 and at_s >= 0")

    def headers(self) -> dict[str, str]:
        """The request's own headers: its session, if it names one."""
        return {SESSION_HEADER: self.session} if self.session is not None else {}

    def body(self, model: str) -> dict[str, Any]:
        """The JSON body: streamed, with the usage chunk, exactly ``max_tokens`` tokens.

        Messages: the leading system message is Anthropic's ``system``; Responses: it is the
        ``instructions``, the turns are the ``input`` items, ``store`` false (the whole
        history every turn, as Codex sends it)."""
        endpoint = self.endpoint
        body: dict[str, Any] = {"model": model, "stream": True, "ignore_eos": True,
                                "temperature": 0}
        if endpoint is Endpoint.COMPLETIONS:
            return {**body, "prompt": self.prompt, "max_tokens": self.max_tokens,
                    "stream_options": {"include_usage": True}}
        turns = [{"role": r, "content": self._content(i, c)}
                 for i, (r, c) in enumerate(self.messages)]
        if endpoint is Endpoint.CHAT:
            return {**body, "messages": turns, "max_tokens": self.max_tokens,
                    "stream_options": {"include_usage": True}}
        system = [t["content"] for t in turns if t["role"] == "system"]
        turns = [t for t in turns if t["role"] != "system"]
        if endpoint is Endpoint.MESSAGES:
            return {**body, "max_tokens": self.max_tokens, "messages": turns,
                    **({"system": system[0]} if system else {})}
        return {**body, "max_output_tokens": self.max_tokens, "store": False, "input": turns,
                **({"instructions": system[0]} if system else {})}

    def _content(self, message: int, text: str) -> str | list[dict[str, Any]]:
        """A message's content: its text, after its images when it has any."""
        urls = [url for i, url in self.images if i == message]
        if not urls:
            return text
        return [*({"type": "image_url", "image_url": {"url": url}} for url in urls),
                {"type": "text", "text": text}]

    def digest(self) -> str:
        """A fingerprint of what is sent and when (checks every contender got the same)."""
        sent: list[Any] = [self.id, self.endpoint.value, self.max_tokens, self.at_s,
                           self.after, self.prompt, self.messages]
        if self.session is not None:
            sent.append(self.session)
        if self.images:
            sent.append(self.images)
        payload = json.dumps(sent, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, fixed list of requests plus how it was derived (for the report)."""

    name: str
    title: str
    source: str
    requests: tuple[Request, ...]
    params: Mapping[str, Any] = field(default_factory=dict)
    stages: tuple[float, ...] = ()
    """Offered rate (req/s) of each ladder step, when the workload has a ladder."""
    kv_blocks: int | None = None
    """The per-worker KV pool (blocks) this workload prescribes; ``None``: the runner's rule."""
    capacity_fraction: float | None = None
    """The per-worker KV pool as a fraction of the workload's distinct prompt pages, when the
    runner's default fraction would let one worker hold its live working set."""
    engine: str | None = None
    """The engine the sims imitate for this workload (``"vllm"``); ``None``: SGLang."""

    def __post_init__(self) -> None:
        ids = [r.id for r in self.requests]
        if ids != list(range(len(ids))):
            raise ValueError("request ids must be 0..n-1 in order")
        for r in self.requests:
            if r.after is not None and not 0 <= r.after < r.id:
                raise ValueError(f"request {r.id} follows {r.after}, which is not before it")

    def digest(self) -> str:
        """One fingerprint of the whole request list."""
        h = hashlib.sha256()
        for r in self.requests:
            h.update(r.digest().encode())
        return h.hexdigest()

    @property
    def open_loop_span_s(self) -> float:
        """Latest scheduled send time among requests that follow no other (s)."""
        return max((r.at_s for r in self.requests if r.after is None), default=0.0)

    def __repr__(self) -> str:
        return f"Workload({self.name!r}, {len(self.requests)} requests)"


# ---- Mooncake traces ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One line of a Mooncake trace: ``timestamp`` (ms), lengths in tokens, block ids."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, minutes: float | None = None) -> list[TraceRow]:
    """The trace's rows (in file order) whose timestamp falls in the first ``minutes``."""
    rows: list[TraceRow] = []
    first: int | None = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            item = json.loads(line)
            row = TraceRow(int(item["timestamp"]), int(item["input_length"]),
                           int(item["output_length"]), tuple(int(i) for i in item["hash_ids"]))
            first = row.timestamp_ms if first is None else first
            if minutes is not None and row.timestamp_ms - first >= minutes * 60_000:
                break
            rows.append(row)
    return rows


def _scaled(tokens: int, tokens_per_block: int) -> int:
    return max(1, round(tokens * tokens_per_block / TRACE_BLOCK_TOKENS))


def mooncake(rows: Sequence[TraceRow], text: BlockText, *, name: str, title: str, source: str,
             speedup: float, max_requests: int | None = None) -> Workload:
    """Replay trace rows as completions: every full 512-token block becomes
    ``text.tokens_per_block`` tokens of its id, the last (partial) block its scaled share,
    the output the scaled output length; arrival times divided by ``speedup``."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    b = text.tokens_per_block
    chosen = list(rows[:max_requests] if max_requests is not None else rows)
    t0 = chosen[0].timestamp_ms if chosen else 0
    requests = []
    for i, row in enumerate(chosen):
        ids = row.hash_ids
        last = row.input_length - (len(ids) - 1) * TRACE_BLOCK_TOKENS
        tokens = (len(ids) - 1) * b + min(b, _scaled(last, b))
        prompt = text.text(Segment(ids, tokens))
        requests.append(Request(i, Endpoint.COMPLETIONS, _scaled(row.output_length, b),
                                (row.timestamp_ms - t0) / 1000 / speedup, prompt=prompt))
    span_min = (chosen[-1].timestamp_ms - t0) / 60_000 if chosen else 0.0
    return Workload(name, title, source, tuple(requests), {
        "trace_requests": len(chosen), "trace_minutes": round(span_min, 2),
        "tokens_per_block": b, "token_scale": f"{b}/{TRACE_BLOCK_TOKENS}",
        "speedup": speedup, "max_requests": max_requests})


# ---- llm-d shared prefix ----------------------------------------------------------------------


def poisson_ladder(rates: Sequence[float], stage_s: float, rng: random.Random
                   ) -> list[tuple[float, int]]:
    """Poisson arrival times (s) and their stage: ``rates[k]`` req/s for ``stage_s`` seconds
    each, back to back."""
    out: list[tuple[float, int]] = []
    for k, rate in enumerate(rates):
        start, t = k * stage_s, k * stage_s
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= start + stage_s:
                break
            out.append((t, k))
    return out


class _BlockIds:
    """Fresh block ids, each segment of ``tokens`` tokens getting its own blocks."""

    def __init__(self, tokens_per_block: int) -> None:
        self._next = itertools.count()
        self._b = tokens_per_block

    def segment(self, tokens: int) -> Segment:
        n = -(-tokens // self._b)
        return Segment(tuple(next(self._next) for _ in range(n)), tokens)


def shared_prefix(text: BlockText, *, groups: int, users: int, system_tokens: int,
                  question_tokens: int, output_tokens: int, rates: Sequence[float],
                  stage_s: float, seed: int) -> Workload:
    """GxU completion prompts ``system(g) + question(g, u)``, shuffled, cycled in that order
    over Poisson arrivals at each rate of the ladder (like ``inference-perf``)."""
    ids = _BlockIds(text.tokens_per_block)
    prompts: list[str] = []
    for _ in range(groups):
        system = text.text(ids.segment(system_tokens))
        prompts.extend(system + text.text(ids.segment(question_tokens)) for _ in range(users))
    rng = random.Random(seed)
    rng.shuffle(prompts)
    arrivals = poisson_ladder(rates, stage_s, rng)
    cycle: Iterator[str] = itertools.cycle(prompts)
    requests = tuple(Request(i, Endpoint.COMPLETIONS, output_tokens, round(t, 6),
                             prompt=next(cycle), stage=k)
                     for i, (t, k) in enumerate(arrivals))
    return Workload(
        "shared_prefix", "Shared-prefix profile (llm-d)",
        "llm-d inference-scheduling guide benchmark: inference-perf `shared_prefix`, 150 groups"
        " x 5 users, 6,000-token system prompt, 1,200-token question, 1,000 output tokens,"
        " Poisson rate ladder", requests,
        {"groups": groups, "users": users, "system_tokens": system_tokens,
         "question_tokens": question_tokens, "output_tokens": output_tokens,
         "rates": list(rates), "stage_s": stage_s, "seed": seed,
         "passes": round(len(requests) / max(len(prompts), 1), 2)},
        stages=tuple(float(r) for r in rates))


# ---- multi-turn (agent) -------------------------------------------------------------------------


def multi_turn(text: BlockText, *, clients: int, rounds: int, system_tokens: int,
               user_tokens: int, output_tokens: int, client_rate: float, think_s: float,
               seed: int) -> Workload:
    """Chat clients starting as a Poisson process at ``client_rate``/s; each runs ``rounds``
    requests in sequence, ``Exp(think_s)`` seconds apart. Round k sends the shared system
    prompt, the client's k+1 user turns and its k previous answers (``output_tokens`` each,
    fixed text so that every contender receives the same requests)."""
    ids = _BlockIds(text.tokens_per_block)
    rng = random.Random(seed)
    system = ("system", text.text(ids.segment(system_tokens)))
    starts = list(itertools.accumulate(rng.expovariate(client_rate) for _ in range(clients)))
    requests: list[Request] = []
    for c, start in enumerate(starts):
        history: list[tuple[str, str]] = [system]
        previous: int | None = None
        for k in range(rounds):
            history.append(("user", text.text(ids.segment(user_tokens))))
            at_s = round(start, 6) if previous is None else round(rng.expovariate(1 / think_s), 6)
            rid = len(requests)
            requests.append(Request(rid, Endpoint.CHAT, output_tokens, at_s,
                                    messages=tuple(history), after=previous, conversation=c,
                                    turn=k))
            history.append(("assistant", text.text(ids.segment(output_tokens))))
            previous = rid
    return Workload(
        "multi_turn", "Multi-turn agent sessions",
        "SGLang `benchmark/hicache/bench_multiturn.py` pattern: clients x rounds, each round"
        " appends a request and the answer to the history", tuple(requests),
        {"clients": clients, "rounds": rounds, "system_tokens": system_tokens,
         "user_tokens": user_tokens, "output_tokens": output_tokens,
         "client_rate": client_rate, "think_s": think_s, "seed": seed})


# ---- agent sessions (issue 29) ------------------------------------------------------------------


AGENT_APIS = {Endpoint.CHAT: "agents", Endpoint.MESSAGES: "agents_messages",
              Endpoint.RESPONSES: "agents_responses"}
"""The agent workload's name per API its clients speak."""


def agent_sessions(text: BlockText, *, agents: int, sessions: int, turns: tuple[int, int],
                   system_tokens: tuple[int, int], task_tokens: int, tool_tokens: int,
                   output_tokens: int, session_rate: float, think_s: float,
                   seed: int, endpoint: Endpoint = Endpoint.CHAT) -> Workload:
    """Coding-agent sessions on ``agents`` distinct agent prompts (system prompt plus tool
    schema, ``system_tokens`` long, drawn uniformly), each session on one of them.
    Sessions start as a Poisson process at ``session_rate``/s (so several run at once) and
    run a uniform number of ``turns`` in sequence: the first sends the task
    (``task_tokens``), every later turn appends the previous answer (``output_tokens``) and
    a short tool result (``tool_tokens``), ``Exp(think_s)`` seconds after the answer (the
    tool running). Every request names its session in :data:`SESSION_HEADER`.
    The Responses variant runs on vLLM sims: Cortex models vLLM's Responses conversion
    (SGLang's is relayed by load, docs/gateway.md).

    ``endpoint``: the API the clients speak (chat completions; Anthropic Messages as
    Claude-Code-style clients; stateless Responses as Codex-style ones) — the same sessions,
    the same prompt tokens."""
    ids = _BlockIds(text.tokens_per_block)
    rng = random.Random(seed)
    prompts = [("system", text.text(ids.segment(rng.randint(*system_tokens))))
               for _ in range(agents)]
    starts = list(itertools.accumulate(rng.expovariate(session_rate) for _ in range(sessions)))
    requests: list[Request] = []
    session_turns = []
    for s, start in enumerate(starts):
        name = f"agent-session-{seed}-{s}"
        history: list[tuple[str, str]] = [prompts[rng.randrange(agents)],
                                          ("user", text.text(ids.segment(task_tokens)))]
        previous: int | None = None
        n = rng.randint(*turns)
        session_turns.append(n)
        for k in range(n):
            if k:
                history.append(("assistant", text.text(ids.segment(output_tokens))))
                history.append(("user", text.text(ids.segment(tool_tokens))))
            at_s = round(start, 6) if previous is None else round(rng.expovariate(1 / think_s), 6)
            rid = len(requests)
            requests.append(Request(rid, endpoint, output_tokens, at_s,
                                    messages=tuple(history), after=previous, conversation=s,
                                    turn=k, session=name))
            previous = rid
    api = {Endpoint.CHAT: "chat completions", Endpoint.MESSAGES: "Anthropic Messages",
           Endpoint.RESPONSES: "stateless Responses"}[endpoint]
    return Workload(
        AGENT_APIS[endpoint], f"Coding-agent sessions on {api} (session header, think time)",
        "issue 29's agent workload: a 10-30k-token agent prompt (system + tool schema) shared"
        " by the sessions of one agent, 10-40 short tool-result turns per session with think"
        f" time between them, sessions overlapping; {endpoint.path} with `x-session-id`",
        tuple(requests),
        {"agents": agents, "sessions": sessions, "turns": list(turns),
         "turns_mean": round(sum(session_turns) / max(len(session_turns), 1), 1),
         "system_tokens": list(system_tokens), "task_tokens": task_tokens,
         "tool_tokens": tool_tokens, "output_tokens": output_tokens,
         "session_rate": session_rate, "think_s": think_s, "seed": seed},
        engine="vllm" if endpoint is Endpoint.RESPONSES else None)


# ---- multimodal (issue 31) ----------------------------------------------------------------------


def png_data_url(width: int, height: int, shade: int) -> str:
    """A ``data:`` URL of a ``width`` x ``height`` PNG of one colour (``shade`` sets it:
    distinct shades, distinct bytes)."""
    row = b"\x00" + bytes([shade % 256, (shade // 256) % 256, 90]) * width
    raw = row * height

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    data = (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(data).decode()


def multimodal(text: BlockText, *, conversations: int, rounds: tuple[int, int], images: int,
               sides: Sequence[tuple[int, int]], popularity: float, system_tokens: int,
               question_tokens: int, output_tokens: int, new_image: float,
               conversation_rate: float, think_s: float, capacity_fraction: float,
               seed: int) -> Workload:
    """Vision-language chat conversations behind one shared system prompt. ``images``
    distinct images (one-colour PNGs, each of a size drawn from ``sides`` in pixels) are
    drawn with Zipf weights ``1 / rank ** popularity``, so popular ones come back in new
    conversations. Conversations start as a Poisson process at ``conversation_rate``/s and
    run a uniform number of ``rounds``: the first asks a question (``question_tokens``)
    about one image; every later one appends the answer (``output_tokens``) and a follow-up
    question ``Exp(think_s)`` seconds after it, with another image with probability
    ``new_image`` — so a conversation re-sends its images, and different images follow the
    shared text. Conversations are short, so the live working set is a small part of all
    the distinct pages: each worker's pool is ``capacity_fraction`` of them, small enough
    that one worker cannot hold what is live (the cluster can)."""
    ids = _BlockIds(text.tokens_per_block)
    rng = random.Random(seed)
    pool = [png_data_url(*rng.choice(list(sides)), shade=k + 1) for k in range(images)]
    weights = [1 / (k + 1) ** popularity for k in range(images)]
    system = ("system", text.text(ids.segment(system_tokens)))
    starts = list(itertools.accumulate(rng.expovariate(conversation_rate)
                                       for _ in range(conversations)))
    requests: list[Request] = []
    used: set[str] = set()
    for c, start in enumerate(starts):
        history: list[tuple[str, str]] = [system, ("user", text.text(ids.segment(
            question_tokens)))]
        shown = [(1, rng.choices(pool, weights)[0])]
        previous: int | None = None
        for k in range(rng.randint(*rounds)):
            if k:
                history.append(("assistant", text.text(ids.segment(output_tokens))))
                history.append(("user", text.text(ids.segment(question_tokens))))
                if rng.random() < new_image:
                    shown.append((len(history) - 1, rng.choices(pool, weights)[0]))
            at_s = round(start, 6) if previous is None else round(rng.expovariate(1 / think_s), 6)
            rid = len(requests)
            requests.append(Request(rid, Endpoint.CHAT, output_tokens, at_s,
                                    messages=tuple(history), after=previous, conversation=c,
                                    turn=k, images=tuple(shown)))
            used.update(url for _, url in shown)
            previous = rid
    return Workload(
        "multimodal", "Vision-language conversations (shared system prompt, repeated and new"
        " images)",
        "issue 31's multimodal workload: one shared system prompt, a question about an image"
        " (data URL, popular images return in new conversations), follow-up turns about the"
        " same image or a new one; chat completions to vLLM workers serving a Qwen2.5-VL"
        "-shaped model", tuple(requests),
        {"conversations": conversations, "rounds": list(rounds), "images": images,
         "images_used": len(used), "sides": [list(s) for s in sides],
         "popularity": popularity, "system_tokens": system_tokens,
         "question_tokens": question_tokens, "output_tokens": output_tokens,
         "new_image": new_image, "conversation_rate": conversation_rate, "think_s": think_s,
         "capacity_fraction": capacity_fraction, "seed": seed},
        capacity_fraction=capacity_fraction)
