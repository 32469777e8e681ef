"""The prefill/decode handoff on the wire (pure): bootstrap rooms and fields, vLLM leg bodies,
usage and logprob merges."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cortex.gateway.dispatch.pd.handoff import (
    MAX_ROOM,
    bootstrap_host,
    bootstrap_room,
    input_logprobs_rewrite,
    merge_input_logprobs_body,
    prefill_input_logprobs,
    sequence_count,
    sglang_leg_body,
    usage_from_prefill,
    usage_rewrite,
    vllm_decode_body,
    vllm_prefill_body,
    wants_input_logprobs,
)
from cortex.gateway.request.payload import InferencePath
from cortex.gateway.upstream.sse import SSEForwarder, first_event_error
from cortex.hashing import Engine
from cortex.registry import WorkerSpec


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


STREAM = (b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
          b'data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":3,'
          b'"total_tokens":43,"prompt_tokens_details":{"cached_tokens":40}}}\n\n'
          b"data: [DONE]\n\n")


def spec(worker: str, role: str, model: str = "m") -> WorkerSpec:
    return WorkerSpec(id=worker, url=f"http://{worker}:1", engine=Engine.SGLANG, model=model,
                      role=role)  # type: ignore[arg-type]


@given(st.integers(min_value=1, max_value=64), st.data())
def test_rooms_are_in_range_and_select_the_prefill_dp_rank(dp_size: int, data: st.DataObject
                                                           ) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=dp_size - 1))
    rng = random.Random(data.draw(st.integers()))
    rooms = {bootstrap_room(rng, dp_size, rank) for _ in range(20)}
    assert all(0 <= r <= MAX_ROOM and r % dp_size == rank for r in rooms)
    assert len(rooms) == 20  # fresh per request and per retry


def test_room_at_the_top_of_the_range_stays_in_it() -> None:
    class Top(random.Random):
        def getrandbits(self, k: int) -> int:
            return MAX_ROOM

    room = bootstrap_room(Top(), 10, 9)
    assert room <= MAX_ROOM and room % 10 == 9


@pytest.mark.parametrize(("endpoint", "body", "count"), [
    (InferencePath.CHAT, {"messages": []}, 1),
    (InferencePath.CHAT, {"n": 3}, 3),
    (InferencePath.COMPLETIONS, {"prompt": "x"}, 1),
    (InferencePath.COMPLETIONS, {"prompt": [1, 2, 3]}, 1),
    (InferencePath.COMPLETIONS, {"prompt": ["a", "b"], "n": 2}, 4),
    (InferencePath.COMPLETIONS, {"prompt": [[1], [2], [3]]}, 3),
    (InferencePath.GENERATE, {"text": "x"}, 1),
    (InferencePath.GENERATE, {"input_ids": [[1], [2]], "sampling_params": {"n": 2}}, 4),
    (InferencePath.GENERATE, {"text": ["a", "b", "c"]}, 3),
])
def test_sequence_count(endpoint: InferencePath, body: dict[str, Any], count: int) -> None:
    assert sequence_count(endpoint, body) == count


def test_sglang_bootstrap_fields_scalar_list_and_override() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    raw = dumps(body)
    one = json.loads(sglang_leg_body(raw, body, "10.0.0.1", 8998, [7]))
    assert one == {**body, "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998,
                   "bootstrap_room": 7}
    many = json.loads(sglang_leg_body(raw, body, "10.0.0.1", None, [1, 2, 3]))
    assert many["bootstrap_room"] == [1, 2, 3] and many["bootstrap_port"] == [None] * 3
    assert many["bootstrap_host"] == ["10.0.0.1"] * 3
    sneaky = {**body, "bootstrap_room": 5}  # a client's own room never reaches the engine
    assert json.loads(sglang_leg_body(dumps(sneaky), sneaky, "h", 1, [9]))["bootstrap_room"] == 9


def test_bootstrap_host_brackets_ipv6() -> None:
    spec = WorkerSpec(id="p", url="http://[fd00::5]:30000", engine=Engine.SGLANG, model="m",
                      role="prefill", bootstrap_port=8998)  # type: ignore[arg-type]
    assert bootstrap_host(spec) == "[fd00::5]"
    spec = WorkerSpec(id="p", url="http://10.1.2.3:30000", engine=Engine.SGLANG, model="m")
    assert bootstrap_host(spec) == "10.1.2.3"


def test_vllm_prefill_and_decode_bodies() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "max_tokens": 50, "min_tokens": 5,
            "max_completion_tokens": 50, "stream_options": {"include_usage": True}}
    prefill = json.loads(vllm_prefill_body(body))
    assert prefill["stream"] is False and prefill["max_tokens"] == 1
    assert prefill["max_completion_tokens"] == 1
    assert "stream_options" not in prefill and "min_tokens" not in prefill
    assert prefill["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}
    assert "max_completion_tokens" not in json.loads(vllm_prefill_body({"prompt": "x"}))
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_host": "h",
              "remote_port": 5, "some_future_field": {"x": 1}}
    decode = json.loads(vllm_decode_body(dumps(body), body, params))
    assert decode == {**body, "kv_transfer_params": params}  # relayed unchanged


def test_usage_from_prefill_fixes_the_decode_accounting() -> None:
    decode = {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
              "prompt_tokens_details": {"cached_tokens": 96}}
    prefill = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
               "prompt_tokens_details": {"cached_tokens": 32}}
    assert usage_from_prefill(decode, prefill) == {
        "prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107,
        "prompt_tokens_details": {"cached_tokens": 32}}
    older = {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101}
    assert "prompt_tokens_details" not in usage_from_prefill(decode, older)


@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=8))
def test_streamed_usage_is_rewritten_under_any_chunking(cuts: list[int]) -> None:
    points = sorted(set(cuts))
    parts = [STREAM[a:b] for a, b in zip([0, *points], [*points, len(STREAM)], strict=True)]
    rewrite = usage_rewrite({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 0}})
    forwarder = SSEForwarder(strip_usage=False, rewrite=rewrite)
    out = b"".join(forwarder.feed(p) for p in parts) + forwarder.finish()
    events = [e for e in out.decode().split("\n\n") if e]
    assert events[0] == 'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}'
    assert json.loads(events[1][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert events[2] == "data: [DONE]" and forwarder.cached_tokens == 0
    stripped = SSEForwarder(strip_usage=True, rewrite=rewrite)
    out = b"".join(stripped.feed(p) for p in parts) + stripped.finish()
    assert b"usage" not in out and stripped.cached_tokens == 0


def test_non_streamed_usage_rewrite() -> None:
    rewrite = usage_rewrite({"prompt_tokens": 9, "prompt_tokens_details": {"cached_tokens": 4}})
    body = dumps({"id": "x", "usage": {"prompt_tokens": 9, "completion_tokens": 2,
                                       "prompt_tokens_details": {"cached_tokens": 8}}})
    usage = json.loads(rewrite.body(body))["usage"]
    assert usage == {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11,
                     "prompt_tokens_details": {"cached_tokens": 4}}
    assert rewrite.body(b"not json") == b"not json"


def test_input_logprobs_merge_prefill_first() -> None:
    assert wants_input_logprobs(InferencePath.GENERATE, {"return_logprob": True})
    assert not wants_input_logprobs(InferencePath.CHAT, {"return_logprob": True})
    p = dumps({"meta_info": {"input_token_logprobs": [[-1.0, 5], [-2.0, 6]]}})
    d = dumps({"text": "x", "meta_info": {"input_token_logprobs": [[-3.0, 7]]}})
    merged = json.loads(merge_input_logprobs_body(d, prefill_input_logprobs(p, False)))
    assert merged["meta_info"]["input_token_logprobs"] == [[-1.0, 5], [-2.0, 6], [-3.0, 7]]
    batch_p = dumps([{"meta_info": {"input_token_logprobs": [[-1.0, 1]]}},
                     {"meta_info": {"input_token_logprobs": [[-2.0, 2]]}}])
    batch_d = dumps([{"meta_info": {"input_token_logprobs": [[-9.0, 9]]}}] * 2)
    merged_batch = json.loads(merge_input_logprobs_body(
        batch_d, prefill_input_logprobs(batch_p, False)))
    assert [m["meta_info"]["input_token_logprobs"][0][1] for m in merged_batch] == [1, 2]
    streamed_p = (b'data: {"index":1,"meta_info":{"input_token_logprobs":[[-2.0,2]]}}\n\n'
                  b"data: [DONE]\n\n")
    forwarder = SSEForwarder(strip_usage=False,
                             rewrite=input_logprobs_rewrite(prefill_input_logprobs(streamed_p,
                                                                                   True)))
    out = forwarder.feed(b'data: {"index":1,"meta_info":{"input_token_logprobs":[[0,3]]}}\n\n')
    assert json.loads(out[6:])["meta_info"]["input_token_logprobs"] == [[-2.0, 2], [0, 3]]


def test_first_event_error() -> None:
    assert first_event_error(b'data: {"error":{"message":"KVPoll.Failed"}}\n\n') == {
        "message": "KVPoll.Failed"}
    assert first_event_error(b'data: {"choices":[]}\n\ndata: {"error":{}}\n\n') is None
    assert first_event_error(b'data: {"error":{"message":"partial') is None
