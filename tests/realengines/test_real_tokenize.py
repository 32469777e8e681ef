"""The token ids Cortex routes on against the real engine's ``/tokenize``: the Qwen3.5 chat
template (through the gateway's ``/tokenize`` and through ``cortex.chat`` directly) and the
DeepSeek-V4 prompt encoder vLLM runs with ``--tokenizer-mode deepseek_v4``, thinking on and
off (``cortex.chat``'s default tokenizer and template)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from cortex.chat import ChatTokenizer, render_args
from cortex.cli.cluster import LocalCluster
from cortex.hashing import Engine
from cortex.testing.vllm_engines import VllmEngine, VllmInstall

from .conftest import model_dir
from .workload import post, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(300)]

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CHATS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hello there"}]},
    {"messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Wie spät ist es? 日本語 🙂"},
                  {"role": "assistant", "content": "Zwölf."},
                  {"role": "user", "content": "And in Tokyo?"}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [{
                      "id": "call_1", "type": "function", "function": {
                          "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
     "tools": [TOOL]},
    {"messages": [{"role": "user", "content": "Think first."},
                  {"role": "assistant", "content": "42", "reasoning_content": "6 times 7"},
                  {"role": "user", "content": "Why?"}]},
    {"messages": [{"role": "user", "content": "Continue: once upon"},
                  {"role": "assistant", "content": "a time"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "no thinking"}],
     "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
]

DEEPSEEK_CHATS: list[dict[str, Any]] = [
    {**chat, "chat_template_kwargs": {"thinking": thinking}}
    for chat in CHATS[:4] for thinking in (True, False)
]


def engine_ids(engine: VllmEngine, body: dict[str, Any]) -> list[int]:
    status, raw = engine.call("/tokenize", {"model": engine.served_name, **body})
    assert status == 200, raw[:300]
    return list(json.loads(raw)["tokens"])


def test_the_gateway_tokenizes_qwen35_chats_as_the_engine(
    cluster: LocalCluster, engines: list[VllmEngine],
) -> None:
    gateway = cluster.gateway_urls[0]
    for chat in CHATS:
        body = {"model": "tiny-qwen", **chat}
        status, _, raw = post(gateway + "/tokenize", body)
        assert status == 200, raw[:300]
        assert json.loads(raw)["tokens"] == engine_ids(engines[0], chat), chat
    report("tokenize_qwen35_gateway", {"chats": len(CHATS)})


def test_cortex_chat_renders_qwen35_as_the_engine(install: VllmInstall,
                                                   engines: list[VllmEngine]) -> None:
    directory = model_dir(install)
    chat = ChatTokenizer.load(str(directory), str(directory / "chat_template.jinja"))
    for body in CHATS:
        assert chat.encode_chat(render_args(body, Engine.VLLM)) == engine_ids(engines[0], body)


@pytest.fixture(scope="module")
def deepseek(install: VllmInstall, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[VllmEngine]:
    found = VllmInstall.find(models=("model-deepseek",))
    if isinstance(found, str):
        pytest.skip(found)
    with VllmEngine(found, tmp_path_factory.mktemp("deepseek"), model="model-deepseek") as one:
        yield one


def test_cortex_chat_encodes_deepseek_v4_as_vllms_encoder(deepseek: VllmEngine) -> None:
    chat = ChatTokenizer.load()  # the DeepSeek-V4 tokenizer and the repo's template
    mismatches = [body for body in DEEPSEEK_CHATS
                  if chat.encode_chat(render_args(body, Engine.VLLM)) != engine_ids(deepseek,
                                                                                    body)]
    report("tokenize_deepseek_v4", {"chats": len(DEEPSEEK_CHATS), "mismatches": len(mismatches),
                                    "startup_s": deepseek.startup_s})
    assert mismatches == []
