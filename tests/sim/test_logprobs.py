"""Logprobs in the engines' shapes: SGLang ``meta_info`` lists, OpenAI chat and completions."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import aiohttp

from cortex.sim.logprobs import FakeLogprobs
from cortex.sim.testkit import StartSim, chat_body

PROMPT = list(range(1000, 1013))  # 13 prompt tokens


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def events(http: aiohttp.ClientSession, url: str, body: Any) -> list[Any]:
    async with http.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        text = await resp.text()
    out = [block[len("data: "):] for block in text.split("\n\n") if block.startswith("data: ")]
    assert out[-1] == "[DONE]"
    return [json.loads(item) for item in out[:-1]]


def test_values_are_a_function_of_token_and_position() -> None:
    fake = FakeLogprobs(range(100, 200), lambda t: f"<{t}>")
    assert fake.logprob(7, 3) == fake.logprob(7, 3) <= 0.0
    assert fake.logprob(7, 3) != fake.logprob(7, 4)
    top = fake.top(7, 3, 3)
    assert top[0][0] == 7 and len({t[0] for t in top}) == 3
    assert [t[1] for t in top] == sorted((t[1] for t in top), reverse=True)
    first = fake.prompt([5, 6], 0, 2)[0]
    assert first.logprob is None and first.top == ()


async def test_sglang_generate_meta_info_lists(start_sim: StartSim, http: aiohttp.ClientSession
                                               ) -> None:
    sim = await start_sim(engine="sglang")
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True},
            "return_logprob": True}
    status, out = await post(http, sim.url + "/generate", body)
    assert status == 200, out
    meta = out["meta_info"]
    fake = FakeLogprobs([], str)
    # default logprob_start_len (-1): only the last prompt token
    assert meta["input_token_logprobs"] == [[fake.logprob(PROMPT[-1], 12), PROMPT[-1], None]]
    assert [item[1] for item in meta["output_token_logprobs"]] == out["output_ids"]
    assert meta["output_token_logprobs"][0][0] == fake.logprob(out["output_ids"][0], 13)
    assert "output_top_logprobs" not in meta
    status, full = await post(http, sim.url + "/generate", {
        **body, "logprob_start_len": 0, "top_logprobs_num": 2, "return_text_in_logprobs": True})
    meta = full["meta_info"]
    assert len(meta["input_token_logprobs"]) == 13 and meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(item[2], str) for item in meta["output_token_logprobs"])
    assert meta["input_top_logprobs"][0] is None
    assert all(len(top) == 2 and top[0][1] == item[1] for top, item in
               zip(meta["output_top_logprobs"], meta["output_token_logprobs"], strict=True))
    streamed = await events(http, sim.url + "/generate", body)
    assert streamed[-1]["meta_info"]["output_token_logprobs"] == out["meta_info"][
        "output_token_logprobs"]
    assert len(streamed[1]["meta_info"]["output_token_logprobs"]) == 2  # cumulative
    status, err = await post(http, sim.url + "/generate", {**body, "logprob_start_len": 13})
    assert status == 400 and "logprob_start_len" in err["message"]


async def test_openai_chat_logprobs(start_sim: StartSim, http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="vllm", output_tokens=(4, 4))
    body = chat_body("Tell me a story", max_tokens=8, logprobs=True, top_logprobs=2)
    status, out = await post(http, sim.url + "/v1/chat/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] == 4
    assert "".join(e["token"] for e in content[:-1]) == choice["message"]["content"]
    assert content[-1]["token"] == "<\uff5cend\u2581of\u2581sentence\uff5c>"  # the EOS
    assert all(e["bytes"] == list(e["token"].encode()) and len(e["top_logprobs"]) == 2
               and e["top_logprobs"][0]["logprob"] == e["logprob"] for e in content)
    chunks = await events(http, sim.url + "/v1/chat/completions", body)
    streamed = [entry for chunk in chunks for choice in chunk["choices"]
                if choice["logprobs"] for entry in choice["logprobs"]["content"]]
    assert streamed == content
    plain = (await post(http, sim.url + "/v1/chat/completions", chat_body("x")))[1]
    assert plain["choices"][0]["logprobs"] is None
    status, err = await post(http, sim.url + "/v1/chat/completions",
                             chat_body("x", top_logprobs=2))
    assert status == 400 and err["error"]["param"] == "top_logprobs"


async def test_openai_completion_logprobs_with_echo(start_sim: StartSim,
                                                    http: aiohttp.ClientSession) -> None:
    sim = await start_sim(engine="sglang")
    body = {"model": "cortex-sim", "prompt": "one two three", "max_tokens": 3,
            "ignore_eos": True, "logprobs": 1}
    status, out = await post(http, sim.url + "/v1/completions", body)
    assert status == 200, out
    logprobs = out["choices"][0]["logprobs"]
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert "".join(logprobs["tokens"]) == out["choices"][0]["text"]
    assert logprobs["text_offset"][0] == 0 and logprobs["text_offset"] == sorted(
        logprobs["text_offset"])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"])
    status, echoed = await post(http, sim.url + "/v1/completions", {**body, "echo": True})
    logprobs = echoed["choices"][0]["logprobs"]
    prompt_tokens = echoed["usage"]["prompt_tokens"]
    assert len(logprobs["tokens"]) == prompt_tokens + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    chunks = await events(http, sim.url + "/v1/completions", body)
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
    assert [t for lp in streamed for t in lp["tokens"]] == out["choices"][0]["logprobs"]["tokens"]
    assert [o for lp in streamed for o in lp["text_offset"]] == out["choices"][0]["logprobs"][
        "text_offset"]


async def test_sglang_pd_legs_split_the_logprobs(start_sim: StartSim,
                                                 http: aiohttp.ClientSession) -> None:
    """The router merges ``input_token_logprobs = prefill + decode``: the prefill computed
    the prompt, the decode did not; the decode has every output token."""
    regular = await start_sim(engine="sglang")
    prefill = await start_sim(engine="sglang", role="prefill", bootstrap_port=0,
                              bootstrap_timeout_s=10.0)
    decode = await start_sim(engine="sglang", role="decode", transfer_timeout_s=10.0)
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 0}
    pd_body = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap_port,
               "bootstrap_room": random.randrange(2**63)}
    (p_status, p_out), (d_status, d_out) = await asyncio.gather(
        post(http, prefill.url + "/generate", pd_body), post(http, decode.url + "/generate",
                                                            pd_body))
    assert (p_status, d_status) == (200, 200), (p_out, d_out)
    _, r_out = await post(http, regular.url + "/generate", body)
    merged = p_out["meta_info"]["input_token_logprobs"] + d_out["meta_info"][
        "input_token_logprobs"]
    assert merged == r_out["meta_info"]["input_token_logprobs"]
    assert d_out["meta_info"]["output_token_logprobs"] == r_out["meta_info"][
        "output_token_logprobs"]
    assert len(p_out["meta_info"]["output_token_logprobs"]) == 1
