"""Bounded input checked before any work, and client mistakes as 4xx OpenAI errors.

Real sims report their context length the engines' way; the gateway learns it, rejects what
cannot fit without tokenizing or touching a worker, relays engine refusals in its own error
shape and counts the status it actually sent.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import aiohttp
import pytest

from cortex.gateway.config.gateway import ModelConfig, ServerConfig
from cortex.gateway.errors import relayed_error
from cortex.gateway.request.payload import Limits, check_prompt_tokens, model_limits, prompt_chars
from cortex.gateway.server import GatewayServer
from cortex.gateway.tracebacks import TracebackLimiter
from cortex.hashing import Engine
from cortex.sim.server import SimServer
from cortex.testing import wait_until_async

from ..conftest import BLOCK, MODEL, TOKEN, StartGateway, StartSim, spec_of

pytestmark = pytest.mark.timeout(60)

CONTEXT = 2048


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **extra}


async def call(http: aiohttp.ClientSession, gw: GatewayServer, body: Any,
               path: str = "/v1/chat/completions") -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with http.post(gw.url + path, data=data,
                         headers={"content-type": "application/json"}) as resp:
        return resp.status, await resp.json()


async def metric(http: aiohttp.ClientSession, gw: GatewayServer, prefix: str,
                 *labels: str) -> float:
    """The sum of the samples starting with ``prefix`` that carry every one of ``labels``."""
    async with http.get(gw.url + "/metrics") as resp:
        text = await resp.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and all(label in line for label in labels))


async def learned(http: aiohttp.ClientSession, gw: GatewayServer, engine: Engine) -> None:
    def knows() -> bool:
        return gw.gateway.limits(gw.config.models[0]).context_tokens == CONTEXT

    await wait_until_async(knows, timeout=10, what=f"the {engine.value} context length")


@pytest.mark.parametrize("engine", [Engine.SGLANG, Engine.VLLM])
async def test_limits_learned_from_the_engine_reject_before_any_work(
    engine: Engine, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    sim: SimServer = await start_sim(engine=engine, max_model_len=CONTEXT)
    model = ModelConfig(name=MODEL, block_size=BLOCK, engine=engine)
    gw = await start_gateway([spec_of(sim, "w")], models=(model,))
    await learned(http, gw, engine)
    tokenized = 'cortex_gateway_routing_seconds_count{stage="tokenize"}'
    cases: list[tuple[str, dict[str, Any], int, str, str]] = [
        ("/v1/completions", {"model": MODEL, "prompt": [1] * CONTEXT}, 400,
         "context_length_exceeded", "prompt"),
        ("/v1/chat/completions", chat("hi", max_tokens=CONTEXT + 1), 400, "invalid_request",
         "max_tokens"),
        ("/v1/chat/completions", chat("hi", max_completion_tokens=2**40), 400,
         "invalid_request", "max_completion_tokens"),
        ("/v1/chat/completions", chat("hi", max_tokens=2**70), 400, "invalid_request",
         "max_tokens"),
        # text far beyond what CONTEXT tokens can hold: refused without tokenizing
        ("/v1/chat/completions", chat("x" * (CONTEXT * 40)), 400, "context_length_exceeded",
         "messages"),
        ("/v1/completions", {"model": MODEL, "prompt": ["short", "y" * (CONTEXT * 40)]}, 400,
         "context_length_exceeded", "prompt"),
    ]
    if engine is Engine.SGLANG:
        cases.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2**33}},
                      400, "invalid_request", "sampling_params.max_new_tokens"))
    for path, body, status, code, param in cases:
        got, answer = await call(http, gw, body, path)
        assert (got, answer["error"]["code"], answer["error"]["param"]) == (status, code,
                                                                            param), body
    assert await metric(http, gw, tokenized) == 0  # nothing was even tokenized
    # fits alone, not with the completion it asks for: checked on the exact token count
    got, answer = await call(http, gw, {"model": MODEL, "prompt": [1] * 1500,
                                        "max_tokens": 1000}, "/v1/completions")
    assert (got, answer["error"]["code"]) == (400, "context_length_exceeded")
    assert sim.engine.stats_dict()["requests_started"] == 0
    got, _ = await call(http, gw, {"model": MODEL, "prompt": [1] * 1500, "max_tokens": 8},
                        "/v1/completions")
    assert got == 200


async def test_configured_limits_win_over_the_engines(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
) -> None:
    sim = await start_sim(max_model_len=CONTEXT)
    model = ModelConfig(name=MODEL, block_size=BLOCK, max_tokens=16, max_messages=3)
    gw = await start_gateway([spec_of(sim, "w")], models=(model,))
    await learned(http, gw, Engine.SGLANG)
    got, answer = await call(http, gw, chat("hi", max_tokens=17))
    assert (got, answer["error"]["param"]) == (400, "max_tokens")
    many = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4}
    got, answer = await call(http, gw, many)
    assert (got, answer["error"]["param"]) == (400, "messages")
    assert "over this model's limit of 3" in answer["error"]["message"]
    assert sim.engine.stats_dict()["requests_started"] == 0


async def test_client_mistakes_are_4xx_counted_as_sent_and_never_tracebacks(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w")])
    bodies = [
        b'{"model": "cortex-sim", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "cortex-sim", "messages": [{"role": "user", "content": "a\\udfffb"}]}',
        b'{"model": "cortex-sim", "prompt": "x", "\\udc00": 1}',
        b'{"model": "cortex-sim", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
        b'{"model": "cortex-sim", "nest": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"model": "cortex-sim", "prompt": "\xff\xfe"}',
    ]
    caplog.set_level(logging.WARNING)
    for body in bodies:
        got, answer = await call(http, gw, body)
        assert (got, answer["error"]["code"]) == (400, "invalid_json"), body[:60]
    # a surrogate pair is a character like any other
    got, _ = await call(http, gw, b'{"model": "cortex-sim", "max_tokens": 2, "messages": '
                                  b'[{"role": "user", "content": "smile \\ud83d\\ude00"}]}')
    assert got == 200
    counted = 'cortex_gateway_requests_total{endpoint="/v1/chat/completions",'
    assert await metric(http, gw, counted, 'status="400"') == len(bodies)
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert sim.engine.stats_dict()["requests_started"] == 1


async def test_an_internal_error_is_a_500_counted_as_500(
    start_sim: StartSim, start_gateway: StartGateway, http: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    sim = await start_sim()
    gw = await start_gateway([spec_of(sim, "w")])
    router = gw.gateway.router
    assert router is not None

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(router, "route", broken)
    for _ in range(12):
        got, answer = await call(http, gw, chat("hi"))
        assert (got, answer["error"]["code"]) == (500, "internal_error")
        assert "a bug" not in json.dumps(answer)
    counted = 'cortex_gateway_requests_total{endpoint="/v1/chat/completions",'
    assert await metric(http, gw, counted, 'status="500"', 'model="cortex-sim"') == 12
    errors = [r for r in caplog.records if r.name == "cortex.gateway.app"]
    assert len(errors) == 12 and sum(1 for r in errors if r.exc_info) == 10  # rate-limited


@pytest.mark.parametrize("engine", [Engine.SGLANG, Engine.VLLM])
async def test_engine_refusals_are_relayed_as_openai_errors(
    engine: Engine, start_sim: StartSim, start_gateway: StartGateway,
    http: aiohttp.ClientSession,
) -> None:
    # a tiny KV pool: the engine refuses a prompt the gateway has no reason to refuse
    sim = await start_sim(engine=engine, kv_capacity_blocks=4)
    model = ModelConfig(name=MODEL, block_size=BLOCK, engine=engine)
    server = ServerConfig(host="127.0.0.1", port=0, admin_token=TOKEN)
    gw = await start_gateway([spec_of(sim, "w")], models=(model,), server=server)
    got, answer = await call(http, gw, {"model": MODEL, "prompt": [5] * 200, "max_tokens": 2},
                             "/v1/completions")
    assert got == 400
    assert set(answer) == {"error"}  # the gateway's shape, whatever the engine's was
    assert answer["error"]["type"] == "invalid_request_error"
    assert "longer than the KV cache" in answer["error"]["message"]
    assert answer["error"]["code"] == "invalid_request"


def test_relayed_error_shapes() -> None:
    sglang = json.dumps({"object": "error", "message": "This model's maximum context length "
                         "is 8 tokens.", "type": "BadRequestError", "param": None, "code": 400})
    status, body = relayed_error(400, sglang.encode())
    assert status == 400 and json.loads(body)["error"]["code"] == "context_length_exceeded"
    vllm = json.dumps({"error": {"message": "bad", "type": "BadRequestError", "param": "n",
                                 "code": 400}})
    assert json.loads(relayed_error(422, vllm.encode())[1])["error"] == {
        "message": "bad", "type": "invalid_request_error", "param": "n",
        "code": "invalid_request"}
    status, body = relayed_error(501, b"Traceback (most recent call last): secret internals")
    assert status == 502 and b"secret" not in body
    assert json.loads(relayed_error(404, b"<html>")[1])["error"]["code"] == "model_not_found"


def test_limits_arithmetic() -> None:
    learned = model_limits(ModelConfig(name="m"), 4096)
    assert learned == Limits(prompt_tokens=4095, completion_tokens=4096, context_tokens=4096)
    configured = model_limits(ModelConfig(name="m", max_prompt_tokens=100, max_tokens=10), None)
    assert configured == Limits(100, 10, None)
    check_prompt_tokens(learned, {"max_tokens": 96}, 4000, "prompt")
    with pytest.raises(Exception, match="asks for 97 more"):
        check_prompt_tokens(learned, {"max_tokens": 97}, 4000, "prompt")
    body = {"messages": [{"role": "system", "content": "abc"},
                         {"role": "assistant", "content": "dropped by some templates"},
                         {"role": "user", "content": [{"type": "text", "text": "de"},
                                                      {"type": "image_url"}]}]}
    assert prompt_chars(body) == 5
    assert prompt_chars({"prompt": ["ab", "abcd"]}) == 4 and prompt_chars({"text": "xyz"}) == 3


def test_traceback_limiter_admits_a_burst_per_window() -> None:
    now = [0.0]
    limiter = TracebackLimiter(burst=2, window_s=10, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(4)] == [True, True, False, False]
    assert limiter.suppressed == 2
    now[0] = 11
    assert limiter.allow()
