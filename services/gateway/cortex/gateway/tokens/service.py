"""Requests → exact prompt ids, never on the event loop for long, never twice for the same text.

:class:`Tokenization` is the async shell around :mod:`cortex.gateway.tokens.prompt` (one per
gateway process, shared by routing, ``/tokenize`` and answer feeding):

- small prompts are rendered, split and looked up in the model's segment cache inline
  (sub-millisecond when the history is cached);
- prompt text the cache has never seen beyond ``tokenize.offload_chars`` is encoded on
  ``tokenize.workers`` cores in parallel (:class:`~cortex.gateway.tokens.parallel.ParallelEncoder`);
- chat requests past the ``heavy`` bounds are rendered and tokenized in a worker process
  (:class:`~cortex.gateway.tokens.heavylane.HeavyLane`);
- after a response ends, its answer is encoded into the cache on a feeder thread, as the
  next turn will resend it (:meth:`feed_answer`);
- :meth:`walk` encodes a prompt only as far as the ledger match can reach
  (:mod:`cortex.gateway.tokens.prompt`), :meth:`finish_small` the rest at once when it is small
  (``tokenize.inline_rest_bytes``: a thread hop would cost more), else :meth:`finish_later`
  on the feeder thread (shed, and counted, when ``feed_queue`` jobs already wait).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from cortex.chat import ChatError, Encoder, EncoderChoice, RenderArgs, render_args
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import (
    InferencePath,
    InferenceRequest,
    PromptKind,
    check_prompt_tokens,
)
from cortex.gateway.tokens.answers import chat_answers, completion_answers
from cortex.gateway.tokens.heavylane import HeavyLane, TokenizerSpec
from cortex.gateway.tokens.parallel import EncoderMode, ParallelEncoder
from cortex.gateway.tokens.prompt import (
    BytesPerToken,
    Deepest,
    Encoded,
    EncodePlan,
    PromptTokenizer,
    Walk,
    walk,
)

__all__ = ["INLINE_REST_BYTES_FASTOKENS", "INLINE_REST_BYTES_HF", "Tokenization",
           "next_turn"]

log = logging.getLogger(__name__)

# ``tokenize.inline_rest_bytes`` unset: the rest of a walk up to these many UTF-8 bytes is
# encoded on the event loop. Measured (tools/encode_hop.py, docs/bench/overhead.md): handing
# a piece to the feeder thread and back costs ~40-50 µs of CPU and two thread wake-ups;
# fastokens encodes 4 KB of prose in ~60 µs. Hugging Face tokenizers takes ~0.2 ms for 256
# characters and the hop costs it no measurable CPU: its rests always go to the thread.
INLINE_REST_BYTES_FASTOKENS = 4_096
INLINE_REST_BYTES_HF = 0


def next_turn(args: RenderArgs, answer: dict[str, Any]) -> RenderArgs:
    """The rendering arguments of the next turn as far as it is known: the conversation,
    the ``answer`` (an assistant message; a continued prefix merged into it) and an empty
    user message, so that the template renders the answer as history (templates render the
    latest answer differently, e.g. Qwen's ``<think>`` block). Raises :class:`ChatError`."""
    messages = list(args.messages)
    if (args.continue_final_message and messages and messages[-1].get("role") == "assistant"
            and isinstance(messages[-1].get("content"), str)):
        answer = {**answer, "content": messages.pop()["content"] + (answer.get("content") or "")}
    tail = render_args({"messages": [answer, {"role": "user", "content": ""}]},
                       args.engine).messages
    return dataclasses.replace(args, messages=(*messages, *tail), add_generation_prompt=True,
                               continue_final_message=False)


def _answer_tokens(obj: Any, events: bytes | None) -> int:
    """About how many tokens an answer has, without parsing it: the usage's
    ``completion_tokens`` when the response says, else one per streamed event."""
    if isinstance(obj, dict):
        usage = obj.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            return int(usage["completion_tokens"])
        return 1 << 30  # unknown: worth feeding
    return events.count(b"\n\ndata:") + 1 if events else 0


def _text_chars(args: RenderArgs) -> int:
    total = 0
    for message in args.messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, tuple):
            total += sum(len(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return total


def _child_encoder(tokenizer: PromptTokenizer | None) -> EncoderChoice:
    """What a worker process loads: the encoder this process chose for the model
    (``fastokens`` is probed again there and must pass, as here)."""
    if tokenizer is not None and tokenizer.encoder.name == "fastokens":
        return EncoderChoice.FASTOKENS
    return EncoderChoice.HF


class Tokenization:
    """Per model: its :class:`PromptTokenizer` (one segment cache), plus the shared
    parallel encoder, heavy lane and feeder thread. Call from the event loop."""

    def __init__(self, config: GatewayConfig, tokenizers: Mapping[str, PromptTokenizer],
                 metrics: GatewayMetrics) -> None:
        self.config = config.tokenize
        self.tokenizers = tokenizers
        self.metrics = metrics
        models = {m.name: m for m in config.models}
        cfg = self.config
        self.encoder = ParallelEncoder(cfg.workers, EncoderMode(cfg.pool),
                                       {name: m.tokenizer for name, m in models.items()})
        self.heavy = HeavyLane(cfg.workers, {name: TokenizerSpec(
            m.tokenizer, m.chat_template, m.tokenize_cache_tokens, m.tokenize_cache_bytes,
            _child_encoder(tokenizers.get(name))) for name, m in models.items()})
        self._feeder = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="cortex-tokenize-feed")
        self._pending = 0
        self._lock = threading.Lock()
        self.recent: dict[str, dict[str, Any]] = {}  # model -> latest routed text/chat body
        self.ratios = {name: BytesPerToken() for name in tokenizers}  # learned by walks
        for name, tokenizer in tokenizers.items():
            tokenizer.observer = self._observe_segments
            tokenizer.token_observer = self._token_observer(name, tokenizer)

    async def warm(self, encoder: Encoder) -> None:
        """Encode once with ``encoder`` on every thread that encodes: the event loop's (this
        one), the feeder's and the parallel encoder's (:meth:`Encoder.warm`: a thread's
        first encode is slow; start-up pays it, not a request)."""
        encoder.warm()
        await asyncio.get_running_loop().run_in_executor(self._feeder, encoder.warm)
        await self.encoder.warm_threads(encoder.warm)

    # ---- prompts ----

    async def tokens(self, req: InferenceRequest) -> Encoded:
        """The exact prompt token ids the engine will see (first prompt of a batch), with
        the remembered heads that key them cheaply (:class:`Encoded`).

        Raises :class:`ClientError` when the chat template rejects the messages or the
        prompt exceeds the model's limit."""
        prompt = req.prompt
        if prompt.kind is not PromptKind.TOKENS and req.endpoint is not InferencePath.GENERATE:
            self.recent[req.model.name] = req.body  # for the alignment self-check
        if prompt.kind is PromptKind.TOKENS:
            encoded = Encoded(list(prompt.token_ids))
        elif prompt.chat is not None:
            encoded = await self._chat(req.model, prompt.chat)
        else:
            encoded = await self._text(req.model, prompt.text, prompt.add_special_tokens)
        check_prompt_tokens(req.limits, req.body, len(encoded.ids), req.prompt_param)
        return encoded

    def is_heavy(self, args: RenderArgs) -> bool:
        """Whether ``args`` is rendered in a worker process."""
        cfg = self.config
        return len(args.messages) > cfg.heavy_messages or _text_chars(args) > cfg.heavy_chars

    async def chat_tokens(self, model: ModelConfig, args: RenderArgs) -> list[int]:
        """Ids of a chat prompt; raises :class:`ClientError` for what the template
        rejects."""
        return list((await self._chat(model, args)).ids)

    async def text_tokens(self, model: ModelConfig, text: str, add_special_tokens: bool
                          ) -> list[int]:
        """Ids of a completion prompt."""
        return list((await self._text(model, text, add_special_tokens)).ids)

    async def _chat(self, model: ModelConfig, args: RenderArgs) -> Encoded:
        try:
            if self.is_heavy(args):
                self.metrics.child(self.metrics.tokenize_offloaded, model.name, "heavy").inc()
                return Encoded(await self.heavy.tokens(model.name, args))
            tokenizer = self.tokenizers[model.name]
            plan = tokenizer.plan_prompt(tokenizer.prompt(args))
            plan.remember = True  # the next turn starts with its head
        except ChatError as exc:
            raise ClientError(f"messages cannot be rendered: {exc}",
                              code=ErrorCode.INVALID_REQUEST, param=exc.param) from None
        return await self.finish(model, tokenizer, plan)

    async def _text(self, model: ModelConfig, text: str, add_special_tokens: bool
                    ) -> Encoded:
        tokenizer = self.tokenizers[model.name]
        plan = tokenizer.plan(text, add_special_tokens)
        plan.remember = True  # a completion prompt extended next time starts with its head
        return await self.finish(model, tokenizer, plan)

    async def finish(self, model: ModelConfig, tokenizer: PromptTokenizer, plan: EncodePlan
                     ) -> Encoded:
        """``plan``'s ids: inline when little is missing, else on the worker cores."""
        if plan.missing_chars <= self.config.offload_chars:
            ids = plan.finish()
        else:
            self.metrics.child(self.metrics.tokenize_offloaded, model.name, "parallel").inc()
            ids = await self.encoder.finish(model.name, tokenizer, plan)
        return Encoded(ids, plan.used, plan.remembered)

    # ---- lazy ----

    def walk(self, req: InferenceRequest, root: int, deepest: Deepest) -> Walk | None:
        """``req``'s prompt encoded as far as the match can reach (``root``: the chain root
        of its plain keys; ``deepest``: see :func:`~cortex.gateway.tokens.prompt.walk`), on
        the event loop; ``None`` where the walk does not apply (token prompts, heavy chat
        requests): use :meth:`tokens`. A prompt whose length bound might not fit the
        model's limits is encoded fully and checked exactly.

        Raises :class:`ClientError` like :meth:`tokens`."""
        prompt = req.prompt
        model = req.model.name
        if prompt.kind is PromptKind.TOKENS:
            return None
        tokenizer = self.tokenizers[model]
        try:
            if prompt.chat is not None:
                if self.is_heavy(prompt.chat):
                    return None
                plan = tokenizer.plan_prompt(tokenizer.prompt(prompt.chat))
            else:
                plan = tokenizer.plan(prompt.text, prompt.add_special_tokens)
        except ChatError as exc:
            raise ClientError(f"messages cannot be rendered: {exc}",
                              code=ErrorCode.INVALID_REQUEST, param=exc.param) from None
        if req.endpoint is not InferencePath.GENERATE:
            self.recent[model] = req.body  # for the alignment self-check
        lazy = walk(tokenizer, plan, root, req.model.block_size, deepest, self.ratios[model])
        if lazy.complete:
            lazy.finish(tokenizer)  # its fresh pieces into the cache
        try:
            check_prompt_tokens(req.limits, req.body, lazy.max_tokens(), req.prompt_param)
        except ClientError:  # the bound does not fit: the exact length decides
            check_prompt_tokens(req.limits, req.body, len(lazy.finish(tokenizer, keyed=True)),
                                req.prompt_param)
        return lazy

    def inline_rest_bytes(self, model: str) -> int:
        """Up to how many UTF-8 bytes the rest of a walk is encoded on the event loop
        (``tokenize.inline_rest_bytes``; by default where encoding them costs about what
        handing them to the feeder thread costs, which depends on the model's encoder)."""
        configured = self.config.inline_rest_bytes
        if configured is not None:
            return configured
        fast = self.tokenizers[model].encoder.name == "fastokens"
        return INLINE_REST_BYTES_FASTOKENS if fast else INLINE_REST_BYTES_HF

    def finish_small(self, model: str, lazy: Walk) -> Sequence[int] | None:
        """The whole ids of ``lazy`` and its keys of every full block, its rest encoded now
        on the event loop when that rest is at most :meth:`inline_rest_bytes` (a thread hop
        would cost more than the encoding; counted in
        ``tokenize_lazy_rest_total{result=inline}``); else ``None``: use
        :meth:`finish_later`."""
        if lazy.complete or lazy.rest_bytes > self.inline_rest_bytes(model):
            return None
        ids = lazy.finish(self.tokenizers[model], keyed=True)
        self.metrics.child(self.metrics.tokenize_lazy_rest, model, "inline").inc()
        return ids

    def finish_later(self, model: str, lazy: Walk
                     ) -> concurrent.futures.Future[Sequence[int]] | None:
        """Encode the rest of ``lazy`` into the segment cache on the feeder thread (the next
        turn resends it); the future's result is the whole ids. ``None``: already complete,
        or shed because ``feed_queue`` jobs wait (counted in
        ``tokenize_lazy_rest_total{result=shed}``)."""
        m = self.metrics
        if lazy.complete:
            lazy.finish(self.tokenizers[model])  # its fresh pieces into the cache
            return None
        with self._lock:
            if self._pending >= self.config.feed_queue:
                m.child(m.tokenize_lazy_rest, model, "shed").inc()
                return None
            self._pending += 1
        try:
            return self._feeder.submit(self._finish_rest, model, lazy)
        except RuntimeError:  # shutting down
            self._done_feeding()
            return None

    def _finish_rest(self, model: str, lazy: Walk) -> Sequence[int]:
        m = self.metrics
        try:
            ids = lazy.finish(self.tokenizers[model])
        except Exception:
            m.child(m.tokenize_lazy_rest, model, "failed").inc()
            raise
        finally:
            self._done_feeding()
        m.child(m.tokenize_lazy_rest, model, "done").inc()
        return ids

    # ---- answers ----

    def feed_answer(self, req: InferenceRequest, obj: Any = None, events: bytes | None = None
                    ) -> None:
        """Encode the answer of a finished response (its JSON ``obj``, or a stream's
        ``events``) into the cache on the feeder thread; never raises, never waits."""
        if (not self.config.feed_answers or req.endpoint is InferencePath.GENERATE
                or req.prompt.kind is PromptKind.TOKENS or (obj is None and not events)):
            return
        m = self.metrics
        if _answer_tokens(obj, events) < self.config.feed_min_tokens:
            m.child(m.tokenize_answer_feeds, req.model.name, "short").inc()
            return
        with self._lock:
            if self._pending >= self.config.feed_queue:
                m.child(m.tokenize_answer_feeds, req.model.name, "dropped").inc()
                return
            self._pending += 1
        try:
            self._feeder.submit(self._feed, req, obj if isinstance(obj, dict) else None, events)
        except RuntimeError:  # shutting down
            self._done_feeding()

    def _done_feeding(self) -> None:
        with self._lock:
            self._pending -= 1

    def _feed(self, req: InferenceRequest, obj: dict[str, Any] | None, events: bytes | None
              ) -> None:
        model = req.model.name
        result = "fed"
        try:
            result = self._feed_one(req, obj, events)
        except ChatError:
            result = "skipped"  # e.g. tool-call arguments that are not JSON
        except Exception:
            log.exception("feeding an answer failed model=%s", model)
            result = "failed"
        finally:
            self._done_feeding()
            self.metrics.child(self.metrics.tokenize_answer_feeds, model, result).inc()

    def _feed_one(self, req: InferenceRequest, obj: dict[str, Any] | None,
                  events: bytes | None) -> str:
        tokenizer = self.tokenizers[req.model.name]
        prompt = req.prompt
        if prompt.chat is None:
            texts = completion_answers(obj, events)
            for text in texts:
                tokenizer.plan(prompt.text + text, prompt.add_special_tokens).finish()
            return "fed" if texts else "skipped"
        answers = chat_answers(obj, events)
        for answer in answers:
            variants = [answer]
            if "reasoning_content" in answer:  # clients may or may not send it back
                variants.append({k: v for k, v in answer.items() if k != "reasoning_content"})
            for variant in variants:
                args = next_turn(prompt.chat, variant)
                if self.is_heavy(args):
                    self.heavy.feed(req.model.name, args)
                else:
                    tokenizer.plan_prompt(tokenizer.prompt(args)).finish()
        return "fed" if answers else "skipped"

    # ---- metrics ----

    def _observe_segments(self, hits: int, misses: int) -> None:
        m = self.metrics
        if hits:
            m.child(m.tokenize_cache, "hit").inc(hits)
        if misses:
            m.child(m.tokenize_cache, "miss").inc(misses)

    def _token_observer(self, model: str, tokenizer: PromptTokenizer) -> Any:
        m = self.metrics
        hit = m.tokenize_cache_tokens.labels(model=model, result="hit")
        miss = m.tokenize_cache_tokens.labels(model=model, result="miss")
        entries = m.tokenize_cache_entries.labels(model=model)
        size = m.tokenize_cache_bytes.labels(model=model)
        evictions = m.tokenize_cache_evictions.labels(model=model)
        cache = tokenizer.cache
        seen = [cache.stats.evictions]

        def observe(hit_tokens: int, miss_tokens: int) -> None:
            if hit_tokens:
                hit.inc(hit_tokens)
            if miss_tokens:
                miss.inc(miss_tokens)
            entries.set(len(cache))
            size.set(cache.bytes)
            now = cache.stats.evictions
            if now > seen[0]:
                evictions.inc(now - seen[0])
                seen[0] = now

        return observe

    def close(self) -> None:
        """Stop the workers (waits for running encodes and feeds)."""
        self._feeder.shutdown(wait=True, cancel_futures=True)
        self.encoder.close()
        self.heavy.close()

    def __repr__(self) -> str:
        return f"Tokenization({self.encoder!r}, {self.heavy!r}, pending_feeds={self._pending})"
