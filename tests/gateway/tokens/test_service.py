"""Tokenization.walk / finish_later: the lazy walk behind the service's checks, the rest
encoded off the request path and shed under pressure (counted)."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import pytest

from cortex.chat import RenderArgs
from cortex.chat.encoder import Encoder
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig, TokenizeConfig
from cortex.gateway.errors import ClientError, ConfigError, ErrorCode
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, InferenceRequest, Limits, parse_request
from cortex.gateway.tokens.prompt import PromptTokenizer
from cortex.gateway.tokens.service import (
    INLINE_REST_BYTES_FASTOKENS,
    INLINE_REST_BYTES_HF,
    Tokenization,
    next_turn,
)
from cortex.hashing import Engine, block_keys

CONFIG = GatewayConfig(models=(ModelConfig(name="m", block_size=16),))
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def prose(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture
def service() -> Iterator[tuple[Tokenization, GatewayMetrics]]:
    config = GatewayConfig(models=(ModelConfig(name="m", block_size=16),),
                           tokenize=TokenizeConfig(encoder="hf", feed_queue=1, heavy_messages=8))
    metrics = GatewayMetrics()
    tokenization = Tokenization(config, {"m": PromptTokenizer.load().fork()}, metrics)
    yield tokenization, metrics
    tokenization.close()


def chat(config: GatewayConfig, content: str, limits: Limits | None = None,
         messages: int = 1) -> InferenceRequest:
    body = {"model": "m", "max_tokens": 10,
            "messages": [{"role": "user", "content": content}] * messages}
    return parse_request(InferencePath.CHAT, body, config,
                         (lambda _: limits) if limits is not None else None)


def nobody(keys: list[int]) -> int:
    return 0


async def test_a_never_seen_prompt_stops_early_and_the_rest_is_finished_later(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    tokenization, metrics = service
    req = chat(CONFIG, prose(1, 3_000))
    assert req.prompt.chat is not None
    tok = tokenization.tokenizers["m"]
    exact = tok.fork().encode_prompt(tok.prompt(req.prompt.chat))
    lazy = tokenization.walk(req, 1, nobody)
    assert lazy is not None and not lazy.complete
    assert len(lazy.ids) < len(exact) // 5 and lazy.ids.tolist() == exact[:len(lazy.ids)]
    future = tokenization.finish_later("m", lazy)
    assert future is not None
    assert list(await asyncio.wait_for(asyncio.wrap_future(future), 30)) == exact
    assert metrics.tokenize_lazy_rest.labels(model="m", result="done")._value.get() == 1
    assert tok.plan_prompt(tok.prompt(req.prompt.chat)).missing == []  # all in the cache


def test_a_small_rest_is_finished_at_once_a_large_one_is_left_to_the_thread(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    tokenization, metrics = service
    assert tokenization.inline_rest_bytes("m") == INLINE_REST_BYTES_HF  # the hf encoder's
    req = chat(CONFIG, prose(11, 3_000))
    assert req.prompt.chat is not None
    tok = tokenization.tokenizers["m"]
    exact = tok.fork().encode_prompt(tok.prompt(req.prompt.chat))
    lazy = tokenization.walk(req, 1, nobody)
    assert lazy is not None and lazy.rest_bytes > INLINE_REST_BYTES_HF
    assert tokenization.finish_small("m", lazy) is None and not lazy.complete
    config = GatewayConfig(models=CONFIG.models,
                           tokenize=TokenizeConfig(encoder="hf", inline_rest_bytes=1 << 20))
    roomy = Tokenization(config, {"m": tok.fork()}, metrics)
    try:
        lazy = roomy.walk(req, 1, nobody)
        assert lazy is not None and not lazy.complete
        whole = roomy.finish_small("m", lazy)
        assert whole is not None and list(whole) == exact and lazy.complete
        assert lazy.keys == block_keys(exact, 16, 1)  # on from the walked ones
        assert metrics.tokenize_lazy_rest.labels(model="m", result="inline")._value.get() == 1
    finally:
        roomy.close()


def test_the_inline_rest_default_follows_the_encoder() -> None:
    tok = PromptTokenizer.load().fork()
    tok.use_encoder(Encoder("fastokens", "test: any fast encoder", tok.encoder.backend))
    tokenization = Tokenization(CONFIG, {"m": tok}, GatewayMetrics())
    try:
        assert tokenization.inline_rest_bytes("m") == INLINE_REST_BYTES_FASTOKENS
    finally:
        tokenization.close()
    with pytest.raises(ConfigError):
        TokenizeConfig(inline_rest_bytes=-1)


async def test_rests_beyond_the_queue_are_shed_and_counted(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    tokenization, metrics = service
    config = CONFIG
    walks = [tokenization.walk(chat(config, prose(seed, 2_000)), 1, nobody)
             for seed in range(2, 6)]
    futures = [tokenization.finish_later("m", w) for w in walks if w is not None]
    shed = metrics.tokenize_lazy_rest.labels(model="m", result="shed")._value.get()
    assert shed >= 1 and futures.count(None) == shed  # feed_queue=1: never queued unbounded
    for future in futures:
        if future is not None:
            await asyncio.wait_for(asyncio.wrap_future(future), 30)


def test_token_and_heavy_prompts_are_not_walked(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    tokenization, _ = service
    config = CONFIG
    tokens = parse_request(InferencePath.COMPLETIONS, {"model": "m", "prompt": [1, 2, 3]},
                           config)
    assert tokenization.walk(tokens, 1, nobody) is None
    assert tokenization.walk(chat(config, "hi", messages=9), 1, nobody) is None


def test_the_context_check_uses_the_bound_then_the_exact_length(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    tokenization, _ = service
    config = CONFIG
    text = prose(9, 600)
    tok = tokenization.tokenizers["m"]
    args = chat(config, text).prompt.chat
    assert args is not None
    exact = len(tok.fork().encode_prompt(tok.prompt(args)))
    # fits, although the byte bound does not: encoded fully, accepted
    lazy = tokenization.walk(chat(config, text, Limits(prompt_tokens=exact)), 1, nobody)
    assert lazy is not None and lazy.complete and len(lazy.ids) == exact
    assert lazy.keys == block_keys(lazy.ids, 16, 1)  # every block keyed, as complete says
    # does not fit: rejected like tokens() rejects it
    with pytest.raises(ClientError) as caught:
        tokenization.walk(chat(config, text, Limits(prompt_tokens=exact - 1)), 1, nobody)
    assert caught.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED
    # a generous limit: the bound fits, nothing past the first blocks is encoded (a text
    # not seen yet: the cached pieces of one seen are taken whole, there is nothing to save)
    other = prose(10, 600)
    lazy = tokenization.walk(chat(config, other, Limits(prompt_tokens=100 * exact)), 1,
                             nobody)
    assert lazy is not None and not lazy.complete


class _Threads:
    """A real tokenizer's ``encode_batch``, noting the thread of each call."""

    def __init__(self, backend: object) -> None:
        self.backend, self.seen = backend, set[int]()

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> object:
        self.seen.add(threading.get_ident())
        return self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)  # type: ignore[attr-defined]


async def test_start_up_warms_every_thread_a_request_encodes_on() -> None:
    """A thread's first encode is slow (fastokens: 4 to 230 ms); start-up pays it on the
    event loop's, the feeder's and each parallel encoder's thread, so no request does."""
    config = GatewayConfig(models=(ModelConfig(name="m", block_size=16),),
                           tokenize=TokenizeConfig(encoder="hf", workers=2))
    tok = PromptTokenizer.load().fork()
    threads = _Threads(tok.chat.tokenizer)
    tokenization = Tokenization(config, {"m": tok}, GatewayMetrics())
    try:
        encoder = Encoder("hf", "test", threads)
        await tokenization.warm(encoder)
        warmed, threads.seen = threads.seen, set()
        assert len(warmed) == 4  # this loop's, the feeder's, two parallel workers'
        tok.use_encoder(encoder)
        walked = chat(config, prose(2, 3_000))
        lazy = tokenization.walk(walked, 1, nobody)
        assert lazy is not None and not lazy.complete
        future = tokenization.finish_later("m", lazy)
        assert future is not None
        await asyncio.wait_for(asyncio.wrap_future(future), 30)
        await tokenization.tokens(chat(config, prose(3, 3_000)))  # the parallel encoder
        assert len(threads.seen) >= 3 and threads.seen <= warmed
    finally:
        tokenization.close()


async def test_a_routed_prompts_full_encode_keeps_its_head_an_answer_fed_does_not(
        service: tuple[Tokenization, GatewayMetrics]) -> None:
    """Encoded whole (PD, the ledger over gRPC), a routed turn's head is remembered: the next
    turn plans only its new text. An answer fed to the cache leaves the heads alone (its
    longer head would displace a walked one's, which carries its keys)."""
    tokenization, _ = service
    tok = tokenization.tokenizers["m"]
    assert tok.heads is not None
    model = CONFIG.models[0]
    messages = [{"role": "user", "content": prose(4, 400)}]
    args = RenderArgs.of(Engine.SGLANG, messages)
    # the next turn's prompt encoded as the answer feed does: nothing remembered
    tok.encode_prompt(tok.prompt(next_turn(args, {"role": "assistant", "content": "ok"})))
    assert len(tok.heads) == 0
    first = await tokenization.chat_tokens(model, args)
    assert len(tok.heads) == 1
    messages += [{"role": "assistant", "content": prose(5, 50)},
                 {"role": "user", "content": prose(6, 50)}]
    args = RenderArgs.of(Engine.SGLANG, messages)
    plan = tok.plan_prompt(tok.prompt(args))
    assert plan.used is not None and len(plan.used.ids) <= len(first)
    assert await tokenization.chat_tokens(model, args) == tok.fork().encode_prompt(
        tok.prompt(args))
