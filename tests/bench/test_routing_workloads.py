"""Workloads of ``cortex bench routing``: block text, trace mapping, generators (pure)."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cortex.bench.routing.command import load_chat_tokenizer
from cortex.bench.routing.text import BlockText, Segment, WordVocabulary
from cortex.bench.routing.workloads import (
    Endpoint,
    Request,
    TraceRow,
    Workload,
    agent_sessions,
    load_trace,
    mooncake,
    multi_turn,
    multimodal,
    png_data_url,
    poisson_ladder,
    shared_prefix,
)

B = 32


@pytest.fixture(scope="module")
def chat() -> Any:
    return load_chat_tokenizer()


@pytest.fixture(scope="module")
def text(chat: Any) -> BlockText:
    return BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), B)


@pytest.fixture(scope="module")
def small_text() -> BlockText:
    return BlockText(WordVocabulary(tuple(f"w{chr(97 + i)}{chr(97 + j)}" for i in range(26)
                                          for j in range(26))), 8)


# ---- block text ---------------------------------------------------------------------------


@dataclass
class _Enc:
    ids: list[int]


class _FakeTokenizer:
    """``Ġ`` tokens; ``" bad"`` splits into two tokens, so it must be left out."""

    def get_vocab(self) -> dict[str, int]:
        return {"Ġcat": 1, "Ġdog": 2, "Ġbad": 3, "ĠUpper": 4, "Ġab": 5, "plain": 6, "Ġx1y": 7}

    def encode_batch(self, input: Sequence[Any], is_pretokenized: bool = False,
                     add_special_tokens: bool = True) -> list[_Enc]:
        table = {" cat": [1], " dog": [2], " bad": [8, 9]}
        return [_Enc(table[s]) for s in input]


def test_vocabulary_keeps_only_words_that_are_one_token_alone() -> None:
    assert WordVocabulary.from_tokenizer(_FakeTokenizer()).words == ("cat", "dog")


def test_every_vocabulary_word_is_one_token_in_any_order(chat: Any, text: BlockText) -> None:
    rng = random.Random(3)
    words = rng.choices(text.vocabulary.words, k=3000)
    prompt = "".join(" " + w for w in words)
    assert len(text.vocabulary) > 20_000
    assert len(chat.encode_text(prompt)) == 3000
    messages = [{"role": "system", "content": prompt[:4000]}, {"role": "user", "content": prompt}]
    bare = chat.encode_chat([{"role": "system", "content": ""}, {"role": "user", "content": ""}])
    assert len(chat.encode_chat(messages)) == len(bare) + len(prompt[:4000].split()) + 3000


def test_blocks_are_deterministic_and_spell_their_id(small_text: BlockText) -> None:
    v = len(small_text.vocabulary)
    again = BlockText(small_text.vocabulary, 8)
    assert small_text.words(12345) == again.words(12345)
    assert small_text.words(12345)[:2] == (small_text.vocabulary.words[12345 % v],
                                           small_text.vocabulary.words[12345 // v])
    assert BlockText(small_text.vocabulary, 8, seed=1).words(7)[2:] != small_text.words(7)[2:]
    assert len({small_text.words(i)[:2] for i in range(2000)}) == 2000
    with pytest.raises(ValueError, match="outside"):
        small_text.words(small_text.max_block_id + 1)


def test_segment_text_takes_whole_blocks_then_cuts_the_last(small_text: BlockText) -> None:
    words = small_text.text(Segment((4, 9), 11)).split()
    assert words == [*small_text.words(4), *small_text.words(9)[:3]]
    assert small_text.text(Segment((4, 9), 11)).startswith(" ")
    with pytest.raises(ValueError, match="cannot hold"):
        small_text.text(Segment((4,), 9))


# ---- Mooncake traces ------------------------------------------------------------------------


def _write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_trace_keeps_the_first_minutes(tmp_path: Path) -> None:
    rows = [{"timestamp": t, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}
            for t in (1000, 30_000, 61_000, 120_000)]
    trace = _write_trace(tmp_path / "t.jsonl", rows)
    assert [r.timestamp_ms for r in load_trace(trace, 1)] == [1000, 30_000]  # < 60 s after
    assert len(load_trace(trace)) == 4


def test_equal_hash_ids_give_equal_token_prefixes_and_different_ids_different_blocks(
    chat: Any, text: BlockText,
) -> None:
    rows = [TraceRow(0, 4 * 512, 64, (7, 8, 9, 10)),        # four full blocks
            TraceRow(500, 3 * 512 + 100, 512, (7, 8, 11, 12)),  # shares two, partial last
            TraceRow(900, 512, 1, (13,))]
    w = mooncake(rows, text, name="t", title="t", source="s", speedup=2)
    a, b, c = (chat.encode_text(r.prompt) for r in w.requests)
    assert len(a) == 4 * B and len(b) == 3 * B + round(100 * B / 512) and len(c) == B
    assert a[:2 * B] == b[:2 * B]                      # equal ids: equal tokens
    assert a[2 * B:3 * B] != b[2 * B:3 * B]            # different ids: different blocks
    assert a[2 * B] != b[2 * B]                        # ... from the block's first token
    assert set(a[:B]) != set(c)
    assert [r.max_tokens for r in w.requests] == [4, 32, 1]
    assert [r.at_s for r in w.requests] == [0.0, 0.25, 0.45]
    assert all(r.endpoint is Endpoint.COMPLETIONS and r.after is None for r in w.requests)


def test_mooncake_scaling_and_request_cap(small_text: BlockText) -> None:
    rows = [TraceRow(1000 * i, 1024, 512, (i, i + 100)) for i in range(10)]
    w = mooncake(rows, small_text, name="t", title="t", source="s", speedup=10, max_requests=4)
    assert len(w.requests) == 4
    assert w.params["tokens_per_block"] == 8 and w.params["speedup"] == 10
    assert [len(r.prompt.split()) for r in w.requests if r.prompt] == [16] * 4
    assert w.requests[3].at_s == pytest.approx(0.3)


# ---- shared prefix and multi-turn ----------------------------------------------------------------


def _shared(seed: int, text: BlockText) -> Workload:
    return shared_prefix(text, groups=4, users=3, system_tokens=20, question_tokens=5,
                         output_tokens=7, rates=(20, 40), stage_s=2, seed=seed)


def test_shared_prefix_is_deterministic_with_a_seed(small_text: BlockText) -> None:
    a, b, c = _shared(1, small_text), _shared(1, small_text), _shared(2, small_text)
    assert a.digest() == b.digest() and a.requests == b.requests
    assert a.digest() != c.digest()


def test_shared_prefix_groups_users_cycle_and_ladder(small_text: BlockText) -> None:
    w = _shared(5, small_text)
    prompts = [r.prompt or "" for r in w.requests]
    distinct = list(dict.fromkeys(prompts))
    assert len(distinct) == 12 and prompts[12:24] == prompts[:12]   # shuffled once, cycled
    systems = {p.split()[0:20][0] for p in distinct}
    assert len(systems) == 4                                        # one system prompt per group
    assert all(len(p.split()) == 25 for p in distinct)
    by_system: dict[str, set[str]] = {}
    for p in distinct:
        by_system.setdefault(" ".join(p.split()[:20]), set()).add(" ".join(p.split()[20:]))
    assert sorted(len(q) for q in by_system.values()) == [3, 3, 3, 3]  # unique questions
    stage0 = [r for r in w.requests if r.stage == 0]
    stage1 = [r for r in w.requests if r.stage == 1]
    assert all(r.at_s < 2 for r in stage0) and all(2 <= r.at_s < 4 for r in stage1)
    assert w.stages == (20.0, 40.0) and len(stage1) > len(stage0)


def test_poisson_ladder_rates() -> None:
    arrivals = poisson_ladder((50, 200), 20, random.Random(0))
    counts = [sum(1 for _, k in arrivals if k == s) for s in (0, 1)]
    assert 900 < counts[0] < 1100 and 3700 < counts[1] < 4300
    assert [t for t, _ in arrivals] == sorted(t for t, _ in arrivals)


def test_multi_turn_history_grows_and_rounds_follow_each_other(small_text: BlockText) -> None:
    kw: dict[str, Any] = dict(clients=3, rounds=4, system_tokens=16, user_tokens=6,
                              output_tokens=5, client_rate=2.0, think_s=0.5, seed=9)
    w = multi_turn(small_text, **kw)
    assert w.digest() == multi_turn(small_text, **kw).digest()
    assert len(w.requests) == 12
    for r in w.requests:
        assert r.endpoint is Endpoint.CHAT and r.max_tokens == 5
        assert len(r.messages) == 2 + 2 * r.turn
        assert r.messages[0] == w.requests[0].messages[0]            # shared system prompt
        if r.turn:
            before = w.requests[r.after or 0]
            assert before.conversation == r.conversation and before.turn == r.turn - 1
            assert r.messages[:len(before.messages)] == before.messages
            assert r.messages[len(before.messages)][0] == "assistant"
        else:
            assert r.after is None
    firsts = [r for r in w.requests if r.turn == 0]
    assert len({r.messages[1] for r in firsts}) == 3


def test_chat_turns_extend_the_previous_prompt_token_for_token(chat: Any,
                                                               text: BlockText) -> None:
    w = multi_turn(text, clients=1, rounds=3, system_tokens=40, user_tokens=20,
                   output_tokens=8, client_rate=1.0, think_s=1.0, seed=0)
    ids = [chat.encode_chat([{"role": r, "content": c} for r, c in q.messages])
           for q in w.requests]
    assert ids[1][:len(ids[0])] == ids[0] and ids[2][:len(ids[1])] == ids[1]


def test_agent_sessions_share_a_prompt_grow_by_tool_turns_and_name_their_session(
        small_text: BlockText) -> None:
    kw: dict[str, Any] = dict(agents=2, sessions=5, turns=(3, 6), system_tokens=(40, 80),
                              task_tokens=10, tool_tokens=4, output_tokens=3,
                              session_rate=2.0, think_s=0.5, seed=3)
    w = agent_sessions(small_text, **kw)
    assert w.digest() == agent_sessions(small_text, **kw).digest()
    assert w.digest() != agent_sessions(small_text, **{**kw, "seed": 4}).digest()
    by_session: dict[str, list[Request]] = {}
    for r in w.requests:
        assert r.session is not None and r.headers() == {"x-session-id": r.session}
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) == 5
    systems = {turns[0].messages[0] for turns in by_session.values()}
    assert 1 <= len(systems) <= 2
    for turns in by_session.values():
        assert 3 <= len(turns) <= 6 and turns[0].after is None
        for before, r in itertools.pairwise(turns):
            assert r.after == before.id and r.at_s >= 0
            assert r.messages[:len(before.messages)] == before.messages
            assert [role for role, _ in r.messages[len(before.messages):]] == [
                "assistant", "user"]
    # a request's session is part of what every contender must receive
    r = w.requests[0]
    assert r.digest() != Request(r.id, r.endpoint, r.max_tokens, r.at_s,
                                 messages=r.messages).digest()


@pytest.mark.parametrize("endpoint", [Endpoint.MESSAGES, Endpoint.RESPONSES])
def test_agent_sessions_on_the_agent_apis_send_the_same_prompt_tokens_as_chat(
        chat: Any, text: BlockText, endpoint: Endpoint) -> None:
    from cortex.chat import render_args
    from cortex.chat.messages_api import messages_chat_body, messages_options
    from cortex.chat.responses_api import responses_chat_body
    from cortex.hashing import Engine

    kw: dict[str, Any] = dict(agents=1, sessions=2, turns=(2, 3), system_tokens=(40, 60),
                              task_tokens=10, tool_tokens=4, output_tokens=3,
                              session_rate=2.0, think_s=0.5, seed=3)
    plain, api = agent_sessions(text, **kw), agent_sessions(text, **kw, endpoint=endpoint)
    assert api.name == f"agents_{endpoint.value}" and plain.name == "agents"
    assert api.engine == ("vllm" if endpoint is Endpoint.RESPONSES else None)
    options = messages_options(chat._chat, Engine.SGLANG)
    for a, b in zip(plain.requests, api.requests, strict=True):
        assert (b.endpoint, b.messages, b.session, b.after) == (endpoint, a.messages,
                                                                 a.session, a.after)
        body = b.body("m")
        assert body["stream"] and body["ignore_eos"]
        if endpoint is Endpoint.MESSAGES:  # the system prompt is Anthropic's 'system'
            assert body["system"] == a.messages[0][1] and body["messages"][0]["role"] == "user"
        else:  # ... and the Responses 'instructions', the history stateless
            assert body["instructions"] == a.messages[0][1] and body["store"] is False
            assert body["input"][0]["role"] == "user" and "messages" not in body
        # Messages on SGLang sims, Responses on vLLM ones (api.engine: the conversion
        # Cortex models); the chat the engine renders has the chat workload's tokens
        engine = Engine(api.engine or "sglang")
        converted = (messages_chat_body(body, engine, options)
                     if endpoint is Endpoint.MESSAGES else responses_chat_body(body, engine))
        ids = chat._chat.encode_chat(render_args(converted, engine))
        assert ids == chat.encode_chat([{"role": r, "content": c} for r, c in a.messages])


def test_multimodal_conversations_resend_their_images_and_share_popular_ones(
        small_text: BlockText) -> None:
    kw: dict[str, Any] = dict(conversations=12, rounds=(2, 4), images=5,
                              sides=[(224, 224), (280, 196)], popularity=1.0,
                              system_tokens=40, question_tokens=6, output_tokens=4,
                              new_image=0.5, conversation_rate=2.0, think_s=0.5,
                              capacity_fraction=0.1, seed=2)
    w = multimodal(small_text, **kw)
    assert w.capacity_fraction == 0.1  # the runner sizes the pools by it
    assert w.digest() == multimodal(small_text, **kw).digest()
    assert w.digest() != multimodal(small_text, **{**kw, "seed": 3}).digest()
    convs: dict[int | None, list[Request]] = {}
    for r in w.requests:
        convs.setdefault(r.conversation, []).append(r)
        assert r.endpoint is Endpoint.CHAT and r.images and r.images[0][0] == 1
        assert r.messages[0] == w.requests[0].messages[0]  # one shared system prompt
        body = r.body("m")["messages"]
        for i, url in r.images:  # each image as a part before its message's text
            assert r.messages[i][0] == "user" and url.startswith("data:image/png;base64,")
            parts = body[i]["content"]
            assert {"type": "image_url", "image_url": {"url": url}} in parts
            assert parts[-1] == {"type": "text", "text": r.messages[i][1]}
        assert all(isinstance(m["content"], str) for k, m in enumerate(body)
                   if k not in {i for i, _ in r.images})
    assert len(convs) == 12
    for turns in convs.values():
        for before, r in itertools.pairwise(turns):  # a later turn re-sends every image
            assert r.after == before.id and r.images[:len(before.images)] == before.images
    firsts = [turns[0].images[0][1] for turns in convs.values()]
    assert len(set(firsts)) < len(firsts)  # a popular image returns in a new conversation
    assert any(len(r.images) > 1 for r in w.requests)  # and later turns add new ones
    assert w.params["images_used"] <= 5
    # the images are part of what every contender must receive
    r = w.requests[0]
    assert r.digest() != Request(r.id, r.endpoint, r.max_tokens, r.at_s,
                                 messages=r.messages).digest()


def test_png_data_urls_are_valid_pngs_of_the_size_asked(tmp_path: Path) -> None:
    import base64
    import struct
    import zlib

    url = png_data_url(30, 20, 300)
    data = base64.b64decode(url.removeprefix("data:image/png;base64,"))
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert struct.unpack(">II", data[16:24]) == (30, 20)
    length = struct.unpack(">I", data[33:37])[0]
    raw = zlib.decompress(data[41:41 + length])
    assert len(raw) == 20 * (1 + 3 * 30) and raw[1:4] == bytes([44, 1, 90])
    assert png_data_url(30, 20, 301) != url


def test_request_and_workload_validation() -> None:
    with pytest.raises(ValueError):
        Request(0, Endpoint.CHAT, 4, 0.0, prompt="x")
    with pytest.raises(ValueError):
        Request(0, Endpoint.COMPLETIONS, 0, 0.0, prompt="x")
    ok = Request(0, Endpoint.COMPLETIONS, 4, 0.0, prompt="x")
    with pytest.raises(ValueError, match="ids"):
        Workload("w", "t", "s", (Request(1, Endpoint.COMPLETIONS, 4, 0.0, prompt="x"),))
    with pytest.raises(ValueError, match="follows"):
        Workload("w", "t", "s", (ok, Request(1, Endpoint.COMPLETIONS, 4, 0.0, prompt="y",
                                             after=1)))
    with pytest.raises(ValueError, match="image"):
        Request(0, Endpoint.CHAT, 4, 0.0, messages=(("user", "x"),), images=((1, "u"),))
    body = ok.body("m")
    assert body["stream"] and body["ignore_eos"] and body["stream_options"]["include_usage"]
    assert ok.digest() != Request(0, Endpoint.COMPLETIONS, 4, 0.5, prompt="x").digest()
