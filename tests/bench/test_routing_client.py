"""The routing benchmark's load generator against a real sim on 127.0.0.1: each API's
stream read for its TTFT, its usage and its end (chat, Anthropic Messages, Responses)."""

from __future__ import annotations

import pytest

from cortex.bench.routing.client import drive
from cortex.bench.routing.command import load_chat_tokenizer
from cortex.bench.routing.text import BlockText, WordVocabulary
from cortex.bench.routing.workloads import Endpoint, agent_sessions
from cortex.sim.config import SimConfig, TimingConfig
from cortex.sim.server import SimServer


@pytest.mark.timeout(60)
@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.MESSAGES, Endpoint.RESPONSES])
async def test_agent_sessions_on_every_api_are_answered_counted_and_cached(
        endpoint: Endpoint) -> None:
    chat = load_chat_tokenizer()
    text = BlockText(WordVocabulary.from_tokenizer(chat.tokenizer), 16)
    w = agent_sessions(text, agents=1, sessions=2, turns=(3, 3), system_tokens=(64, 64),
                       task_tokens=8, tool_tokens=4, output_tokens=3, session_rate=50.0,
                       think_s=0.01, seed=1, endpoint=endpoint)
    config = SimConfig(port=0, kv_events_port=0, replay_port=0, block_size=16,
                       kv_capacity_blocks=256, timing=TimingConfig(zero_cost=True),
                       engine=w.engine or "sglang")
    async with SimServer(config) as sim:
        outcomes = await drive(w, sim.url, sim.config.model, timeout_s=20)
    assert len(outcomes) == len(w.requests) == 6
    for o, r in zip(sorted(outcomes, key=lambda o: o.id), w.requests, strict=True):
        assert o.ok, o.error
        assert o.ttft_s is not None and o.done_s is not None and o.ttft_s <= o.done_s - o.sent_s
        # the engine's prompt tokens are the chat rendering's, whatever the API
        assert o.prompt_tokens == len(chat.encode_chat(
            [{"role": role, "content": c} for role, c in r.messages]))
        assert o.completion_tokens == r.max_tokens
        assert o.cached_tokens is not None and 0 <= o.cached_tokens < o.prompt_tokens
        if r.turn:  # a later turn finds the one before it cached
            assert o.cached_tokens >= 64
