"""The token ids Cortex routes on against the real engine's ``/tokenize``: the Qwen3.5 chat
template (through the gateway's ``/tokenize`` and through ``cortex.chat`` directly) and the
DeepSeek-V4 prompt encoder vLLM runs with ``--tokenizer-mode deepseek_v4``, thinking on, off
and by default, and reasoning efforts (``cortex.chat.deepseek_v4``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from cortex.chat import ChatTokenizer, render_args
from cortex.chat.deepseek_v4 import DEEPSEEK_V4_TEMPLATE
from cortex.devcluster.cluster import LocalCluster
from cortex.hashing import Engine
from cortex.testing.vllm_engines import VllmEngine, VllmInstall

from .conftest import model_dir
from .workload import post, report

pytestmark = [pytest.mark.realengine, pytest.mark.timeout(300)]

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

CHATS: list[Any] = [  # bodies, or pytest.param of one with a known difference
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
    # found by this suite: vLLM 0.32 sees the Qwen3.5 template loop over the content in a
    # macro and hands it the parts (cortex.chat used to join them with a newline first)
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
]

def _deepseek(chat: dict[str, Any], thinking: bool | None) -> dict[str, Any]:
    """``thinking`` None: the encoder's default (on)."""
    return chat if thinking is None else {**chat, "chat_template_kwargs": {"thinking": thinking}}


DEEPSEEK_CHATS = [_deepseek(chat, thinking) for chat in CHATS[:4]
                  for thinking in (True, False, None)] + [
    # as a template variable: vLLM's /tokenize drops a request-level reasoning_effort (a
    # chat-completions field), its encoder reads the variable
    {**CHATS[1], "chat_template_kwargs": {"reasoning_effort": effort}}
    for effort in ("none", "low", "max")]


def engine_ids(engine: VllmEngine, body: dict[str, Any]) -> list[int]:
    status, raw = engine.call("/tokenize", {"model": engine.served_name, **body})
    assert status == 200, raw[:300]
    return list(json.loads(raw)["tokens"])


def _ids(chats: list[Any]) -> list[str]:
    """``3-tools``, ``0-thinking=False``: what each chat exercises."""
    shown = ("thinking", "reasoning_effort")  # chat_template_kwargs are listed too
    return ["-".join([str(i), *sorted(f"{k}={v}" if k in shown else k for k, v in
                                      {**c, **c.get("chat_template_kwargs", {})}.items()
                                      if k not in ("messages", "chat_template_kwargs"))])
            for i, c in enumerate(chats)]


@pytest.mark.parametrize("chat", CHATS, ids=_ids(CHATS))
def test_the_gateway_tokenizes_qwen35_chats_as_the_engine(
    cluster: LocalCluster, engines: list[VllmEngine], chat: dict[str, Any],
) -> None:
    status, _, raw = post(cluster.gateway_urls[0] + "/tokenize", {"model": "tiny-qwen", **chat})
    assert status == 200, raw[:300]
    assert json.loads(raw)["tokens"] == engine_ids(engines[0], chat)


@pytest.mark.parametrize("chat", CHATS, ids=_ids(CHATS))
def test_cortex_chat_renders_qwen35_as_the_engine(install: VllmInstall, engines: list[VllmEngine],
                                                   chat: dict[str, Any]) -> None:
    directory = model_dir(install)
    tokenizer = ChatTokenizer.load(str(directory), str(directory / "chat_template.jinja"))
    assert tokenizer.encode_chat(render_args(chat, Engine.VLLM)) == engine_ids(engines[0], chat)


@pytest.fixture(scope="module")
def deepseek(install: VllmInstall, tmp_path_factory: pytest.TempPathFactory,
             ) -> Iterator[VllmEngine]:
    found = VllmInstall.find(models=("model-deepseek",))
    if isinstance(found, str):
        pytest.skip(found)
    with VllmEngine(found, tmp_path_factory.mktemp("deepseek"), model="model-deepseek") as one:
        report("deepseek_engine", {"startup_s": one.startup_s})
        yield one


@pytest.mark.parametrize("chat", DEEPSEEK_CHATS, ids=_ids(DEEPSEEK_CHATS))
def test_cortex_chat_encodes_deepseek_v4_as_vllms_encoder(deepseek: VllmEngine,
                                                          chat: dict[str, Any]) -> None:
    # the DeepSeek-V4 tokenizer and cortex.chat's model of vLLM's deepseek_v4 encoder
    tokenizer = ChatTokenizer.load(chat_template=DEEPSEEK_V4_TEMPLATE)
    ours = tokenizer.encode_chat(render_args(chat, Engine.VLLM))
    theirs = engine_ids(deepseek, chat)
    assert ours == theirs, (tokenizer.decode(ours)[:400], tokenizer.decode(theirs)[:400])
