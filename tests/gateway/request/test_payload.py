"""Request bodies into validated requests (pure): what is refused, with which code."""

from __future__ import annotations

import json

import pytest

from cortex.gateway.config.gateway import GatewayConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.request.payload import InferencePath, PromptKind, parse_body, parse_request
from cortex.hashing import Engine

CONFIG = GatewayConfig.from_mapping({"models": [{"name": "m"}, {"name": "n"}]})


def parse(endpoint: InferencePath, body: object) -> object:
    return parse_request(endpoint, parse_body(json.dumps(body).encode()), CONFIG)


@pytest.mark.parametrize(("endpoint", "body", "code", "status"), [
    (InferencePath.CHAT, [], ErrorCode.INVALID_JSON, 400),
    (InferencePath.CHAT, {"messages": [{"role": "user", "content": "x"}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "zz", "messages": [{"role": "user", "content": "x"}]},
     ErrorCode.MODEL_NOT_FOUND, 404),
    (InferencePath.CHAT, {"model": "m", "messages": []}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user", "content": 5}]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user"}], "stream": "yes"},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.CHAT, {"model": "m", "messages": [{"role": "user"}], "max_tokens": -1},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": [1, -2]}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": [[1], []]},
     ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.COMPLETIONS, {"model": "m", "prompt": {"a": 1}}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.GENERATE, {"sampling_params": {}}, ErrorCode.INVALID_REQUEST, 400),
    (InferencePath.GENERATE, {"input_ids": "abc"}, ErrorCode.INVALID_REQUEST, 400),
])
def test_bad_requests(endpoint: InferencePath, body: object, code: ErrorCode, status: int) -> None:
    with pytest.raises(ClientError) as caught:
        parse(endpoint, body)
    assert (caught.value.code, caught.value.status) == (code, status)


def test_malformed_json() -> None:
    with pytest.raises(ClientError) as caught:
        parse_body(b"{not json")
    assert caught.value.code is ErrorCode.INVALID_JSON
    body = json.loads(caught.value.body())
    assert body["error"]["code"] == "invalid_json"
    assert body["error"]["type"] == "invalid_request_error"


def test_good_requests() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    chat = parse_request(InferencePath.CHAT, {
        "model": "n", "messages": [{"role": "user", "content": "hi"}], "stream": True,
        "stream_options": {"include_usage": True}, "tools": [tool],
        "continue_final_message": True}, CONFIG)
    assert chat.model.name == "n" and chat.stream and chat.wants_usage
    # the rendering arguments are the model's engine's reading of the body (cortex.chat)
    assert chat.prompt.chat is not None and chat.prompt.chat.engine is Engine.SGLANG
    assert chat.prompt.chat.continue_final_message is True
    assert chat.prompt.chat.tools is not None and chat.prompt.chat.tools[0]["function"][
        "name"] == "f"
    batch = parse_request(InferencePath.COMPLETIONS, {"model": "m", "prompt": [[5, 6], [7]]},
                          CONFIG)
    assert batch.prompt.kind is PromptKind.TOKENS and batch.prompt.token_ids == (5, 6)
    gen = parse_request(InferencePath.GENERATE, {"text": ["a", "b"]}, CONFIG)
    assert gen.model.name == "m" and gen.prompt.text == "a"
