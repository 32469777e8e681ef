"""Never-seen text on several cores, the cache's byte bound, Qwen's chunk cuts, heavy requests.

Everything compares against the unsegmented ``cortex.chat`` tokenization of the same text.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cortex.chat import ChatTokenizer, RenderArgs
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig, TokenizeConfig
from cortex.gateway.metrics import GatewayMetrics
from cortex.gateway.request.payload import InferencePath, parse_request
from cortex.gateway.tokens.parallel import EncoderMode, ParallelEncoder, partition
from cortex.gateway.tokens.prompt import PromptTokenizer, SegmentCache
from cortex.gateway.tokens.service import Tokenization
from cortex.hashing import Engine

QWEN = Path(__file__).parents[2] / "chat" / "data" / "qwen3.5"
WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron "
         "pi rho sigma tau upsilon phi chi psi omega").split()


@functools.cache
def qwen() -> ChatTokenizer:
    return ChatTokenizer.load(QWEN)


@functools.cache
def deepseek() -> ChatTokenizer:
    return ChatTokenizer.load()


def prose(words: int, seed: int = 0) -> str:
    return " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{seed}" for i in range(words))


def test_partition_keeps_order_and_balances_characters() -> None:
    texts = [("x" * n, False) for n in (10, 10, 10, 10, 40, 5, 5, 10)]
    groups = partition(texts, 3)
    assert [i for g in groups for i in g] == list(range(len(texts)))
    sizes = [sum(len(texts[i][0]) for i in g) for g in groups]
    assert len(groups) == 3 and max(sizes) <= 50
    assert partition(texts[:2], 8) == [range(0, 1), range(1, 2)]
    assert partition([], 4) == []


def test_the_cache_holds_at_most_its_bytes() -> None:
    cache = SegmentCache(max_tokens=10**9, max_bytes=4_000)
    for i in range(50):
        cache.put((f"piece {i} " * 10, False), list(range(100)))
    assert 0 < cache.bytes <= 4_000 and len(cache) < 50
    assert cache.stats.evictions == 50 - len(cache)
    assert cache.get(("piece 49 " * 10, False)) is not None  # the newest stays
    assert cache.stats.miss_tokens == 5_000 and cache.stats.hit_tokens == 100


@pytest.mark.parametrize("mode", [EncoderMode.THREADS, EncoderMode.PROCESSES])
async def test_never_seen_text_encoded_in_parallel_equals_one_encode(mode: EncoderMode
                                                                     ) -> None:
    tok = PromptTokenizer(deepseek(), chunk_chars=256)
    encoder = ParallelEncoder(2, mode, {"m": None})
    text = prose(3_000)
    plan = tok.plan(text, True)
    assert len(plan.missing) > 8
    try:
        ids = await asyncio.wait_for(encoder.finish("m", tok, plan), 60)
    finally:
        encoder.close()
    assert ids.tolist() == deepseek().encode_text(text)
    assert tok.plan(text, True).missing_chars == 0  # the pieces are cached now


async def test_parallel_groups_run_on_separate_threads() -> None:
    tok = PromptTokenizer(deepseek(), chunk_chars=256)
    names: set[str] = set()
    encode = tok.encode_pieces
    both = threading.Barrier(2, timeout=10)

    def recording(texts: list[tuple[str, bool]]) -> list[list[int]]:
        names.add(threading.current_thread().name)
        both.wait()  # both groups are encoding at the same time
        return encode(texts)

    tok.encode_pieces = recording  # type: ignore[method-assign]
    encoder = ParallelEncoder(2)
    try:
        plan = tok.plan(prose(2_000, seed=1), False)
        assert (await asyncio.wait_for(encoder.finish("m", tok, plan), 30)).tolist() == \
            deepseek().encode(prose(2_000, seed=1), False)
    finally:
        encoder.close()
    assert len(names) == 2 and all(n.startswith("cortex-tokenize") for n in names)


QWEN_CUTTABLE = ["Hello", " world", " a", " Zeta", "x", ".", "..", "'", "'s", "'S", " 's",
                 "\u200b", "\u00a0", "\t", " ", "  ", "7", " 8", "日本", "!a", "\n ", " \n",
                 "é", "e\u0301", "\u0301", "—", "ﬁ", "Å", "A\u030a", "<think>", "<|im_end|>"]


@functools.cache
def qwen_chunked() -> PromptTokenizer:
    return PromptTokenizer(qwen(), cache_tokens=200_000, chunk_chars=2)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(QWEN_CUTTABLE), max_size=60).map("".join), st.booleans())
def test_qwen_chunked_text_equals_whole_text_tokenization(prompt: str, special: bool) -> None:
    tok = qwen_chunked()
    assert tok.chunk_chars == 2  # NFC and Qwen's pre-tokenizer allow cuts
    expected = qwen().encode(prompt, special)
    assert tok.encode(prompt, special) == expected
    assert tok.encode(prompt, special) == expected  # warm


async def test_heavy_chat_requests_are_tokenized_in_a_worker_process() -> None:
    config = GatewayConfig(models=(ModelConfig(name="m"),),
                           tokenize=TokenizeConfig(heavy_messages=4, workers=1))
    metrics = GatewayMetrics()
    tok = PromptTokenizer.load()
    service = Tokenization(config, {"m": tok}, metrics)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"}
                for i in range(9)]
    body = {"model": "m", "messages": messages}
    req = parse_request(InferencePath.CHAT, body, config)
    try:
        ids = list((await asyncio.wait_for(service.tokens(req), 60)).ids)
    finally:
        service.close()
    assert ids == deepseek().encode_chat(RenderArgs.of(Engine.SGLANG, messages))
    assert len(tok.cache) == 0  # not tokenized here
    assert metrics.tokenize_offloaded.labels(model="m", lane="heavy")._value.get() == 1
