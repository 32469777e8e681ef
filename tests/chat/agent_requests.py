"""Agent-shaped request corpora for the Messages and Responses conversions (deterministic).

Each request has a long system prompt and a tool schema, 1-12 turns of text, tool calls and
short tool results, thinking on or off; ``n`` requests from ``seed``.
"""

from __future__ import annotations

import base64
import functools
import gzip
import json
import random
import zlib
from pathlib import Path
from typing import Any

from cortex.chat import ChatError, ChatPrompt, ChatTokenizer, render_args
from cortex.chat.errors import UnmodelledRequest
from cortex.hashing import Engine

_WORDS = ("the repo build test file function error line patch diff module import config "
          "server token cache worker route request answer stream event usage prefix block "
          "naïve 数据 emoji 🙂 \\n quoted \"x\" tab\t").split(" ")


def _text(rng: random.Random, words: int) -> str:
    out = " ".join(rng.choice(_WORDS) for _ in range(words))
    if rng.random() < 0.2:
        out = "\n\n" + out
    if rng.random() < 0.2:
        out += "\n"
    return out


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    names = ["bash", "read_file", "edit_file", "grep", "web_fetch", "todo_write"]
    tools = []
    for name in names[:rng.randint(1, len(names))]:
        properties = {f"arg{i}": {"type": rng.choice(["string", "integer", "boolean"]),
                                  "description": _text(rng, 6)} for i in range(rng.randint(1, 4))}
        schema: dict[str, Any] = {"properties": properties, "required": sorted(properties)[:1]}
        if rng.random() < 0.8:
            schema = {"type": "object", **schema}
        tools.append({"name": name, "description": _text(rng, 30), "input_schema": schema})
    return tools


def _args(rng: random.Random) -> dict[str, Any]:
    return {"command": _text(rng, 4), "n": rng.randint(0, 9), "flag": rng.random() < 0.5}


def messages_request(rng: random.Random, i: int, *, system_role: bool = False
                     ) -> dict[str, Any]:
    """One Anthropic Messages body; ``system_role``: some turns carry ``system`` messages
    (vLLM accepts them)."""
    tools = _tools(rng)
    body: dict[str, Any] = {"model": "m", "max_tokens": rng.choice([1024, 4096, 8192, 32000])}
    if rng.random() < 0.5:
        body["system"] = _text(rng, 120)
    else:
        body["system"] = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; "
                           f"cch={i:05x};"}] * (rng.random() < 0.5) + [
            {"type": "text", "text": _text(rng, 80), "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": _text(rng, 40)}]
    if rng.random() < 0.9:
        body["tools"] = tools
    if rng.random() < 0.3:
        body["tool_choice"] = rng.choice([{"type": "auto"}, {"type": "any"}, {"type": "none"}])
    thinking = rng.random()
    if thinking < 0.3:
        body["thinking"] = {"type": "enabled", "budget_tokens": 2048}
    elif thinking < 0.5:
        body["thinking"] = {"type": "disabled"}
    if rng.random() < 0.3:
        body["stop_sequences"] = ["\n\nHuman:"]
    messages: list[dict[str, Any]] = [{"role": "user", "content": _text(rng, 20)}]
    for turn in range(rng.randint(0, 11)):
        call_id = f"toolu_{i:03d}_{turn:02d}"
        blocks: list[dict[str, Any]] = []
        if thinking < 0.3 and rng.random() < 0.7:
            blocks.append({"type": "thinking", "thinking": _text(rng, 15), "signature": "sig"})
        if rng.random() < 0.6:
            blocks.append({"type": "text", "text": _text(rng, 12)})
        name = tools[rng.randrange(len(tools))]["name"]
        blocks.append({"type": "tool_use", "id": call_id, "name": name, "input": _args(rng)})
        messages.append({"role": "assistant", "content": blocks})
        result: Any = _text(rng, rng.randint(1, 25))
        if rng.random() < 0.3:
            result = [{"type": "text", "text": _text(rng, 5)},
                      {"type": "text", "text": _text(rng, 5)}]
        user: list[dict[str, Any]] = [{"type": "tool_result", "tool_use_id": call_id,
                                       "content": result}]
        if rng.random() < 0.3:
            user.append({"type": "text", "text": _text(rng, 8)})
        messages.append({"role": "user", "content": user})
        if system_role and rng.random() < 0.2:
            messages.append({"role": "system", "content": "<system-reminder>"
                             + _text(rng, 6) + "</system-reminder>"})
            messages.append({"role": "user", "content": _text(rng, 4)})
    if rng.random() < 0.3:
        messages.append({"role": "assistant", "content": [{"type": "text", "text": "Sure"}]})
        messages.append({"role": "user", "content": [{"type": "text", "text": _text(rng, 6)}]})
    body["messages"] = messages
    return body


def responses_request(rng: random.Random, i: int) -> dict[str, Any]:
    """One stateless Responses body, as Codex sends it."""
    body: dict[str, Any] = {"model": "m", "store": False, "instructions": _text(rng, 120)}
    if rng.random() < 0.9:
        body["tools"] = [{"type": "function", "name": t["name"], "description": t["description"],
                          "parameters": {"type": "object", **t["input_schema"]},
                          "strict": rng.choice([False, True, None])}
                         for t in _tools(rng)]
        for tool in body["tools"]:
            if tool["strict"] is None:
                del tool["strict"]
    if rng.random() < 0.5:
        body["reasoning"] = {"effort": rng.choice(["low", "medium", "high", "none"])}
    items: list[dict[str, Any]] = []
    if rng.random() < 0.1:
        items.append({"type": "message", "role": "developer",
                      "content": [{"type": "input_text", "text": _text(rng, 30)}]})
    items.append({"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": _text(rng, 20)}]})
    for turn in range(rng.randint(0, 11)):
        call_id = f"call_{i:03d}_{turn:02d}"
        if rng.random() < 0.5:
            items.append({"type": "reasoning", "id": f"rs_{i}_{turn}", "summary": [],
                          "content": [{"type": "reasoning_text", "text": _text(rng, 12)}]})
        items.append({"type": "function_call", "call_id": call_id, "name": "bash",
                      "arguments": json.dumps(_args(rng))})
        items.append({"type": "function_call_output", "call_id": call_id,
                      "output": _text(rng, rng.randint(1, 25))})
        if rng.random() < 0.3:
            items.append({"type": "message", "role": "assistant", "id": f"msg_{i}_{turn}",
                          "status": "completed",
                          "content": [{"type": "output_text", "text": _text(rng, 10),
                                       "annotations": []}]})
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": _text(rng, 6)}]})
    body["input"] = items
    return body


def _reasoning_blob(text: str) -> str:
    """SGLang's replayable reasoning state (``encrypted_content``): a prefix, then the text
    zlib-compressed in URL-safe base64."""
    return "sglang-reasoning-v1." + base64.urlsafe_b64encode(
        zlib.compress(text.encode("utf-8"))).decode("ascii")


def _sglang_item(rng: random.Random, i: int, turn: int, items: list[dict[str, Any]]) -> None:
    """One turn of the shapes SGLang's conversion treats on its own (merging, phases,
    summaries, developer labels, argument coercion, custom tools)."""
    call_id = f"call_{i:03d}_{turn:02d}"
    roll = rng.random()
    if roll < 0.15:
        items.append({"type": "reasoning", "id": f"rs_{i}_{turn}",
                      "summary": [{"type": "summary_text", "text": _text(rng, 6)}] * (
                          rng.random() < 0.7),
                      "content": [{"type": "reasoning_text", "text": _text(rng, 8)}] * (
                          rng.random() < 0.5)})
    elif roll < 0.2:
        items.append({"type": "reasoning", "id": f"rs_{i}_{turn}", "summary": [],
                      "encrypted_content": rng.choice([_reasoning_blob(_text(rng, 7)),
                                                       "gAAAAopaque"])})
    if rng.random() < 0.35:
        message: dict[str, Any] = {"type": "message", "role": "assistant", "id": f"msg_{i}_{turn}",
                                   "status": "completed", "content": [
                                       {"type": "output_text", "text": _text(rng, 8),
                                        "annotations": []}]}
        if rng.random() < 0.4:
            message["phase"] = rng.choice(["commentary", "final_answer"])
        if rng.random() < 0.2:
            message["content"] = _text(rng, 5)
        items.append(message)
    kind = rng.random()
    if kind < 0.12:
        items.append({"type": "custom_tool_call", "call_id": call_id, "name": "apply_patch",
                      "input": "*** Begin Patch\n" + _text(rng, 6)})
        items.append({"type": "custom_tool_call_output", "call_id": call_id,
                      "output": _text(rng, 4)})
        return
    arguments: Any = json.dumps(_args(rng))
    if kind < 0.2:
        arguments = rng.choice(["", "{\"command\": \"ls", "[1, 2]", "null", "{\"n\": NaN}",
                                "{\"n\": 1e400}", "{\"n\": 1.5e3}"])
    elif kind < 0.26:
        arguments = _args(rng)
    items.append({"type": "function_call", "call_id": call_id, "name": "bash",
                  "arguments": arguments, "id": f"fc_{i}_{turn}", "status": "completed"})
    if rng.random() < 0.15:  # parallel calls: a second one before the outputs
        items.append({"type": "function_call", "call_id": call_id + "b", "name": "grep",
                      "arguments": json.dumps(_args(rng))})
        items.append({"type": "function_call_output", "call_id": call_id + "b",
                      "output": _text(rng, 3)})
    output: Any = _text(rng, rng.randint(1, 20))
    if rng.random() < 0.15:
        output = [{"type": "input_text", "text": _text(rng, 4)},
                  {"type": "input_text", "text": _text(rng, 4)}]
    items.append({"type": "function_call_output", "call_id": call_id, "output": output})


def sglang_responses_request(rng: random.Random, i: int) -> dict[str, Any]:
    """A stateless Responses body with the shapes SGLang's conversion decides on its own:
    developer and system items, assistant messages with phases, reasoning summaries and
    replayed reasoning state, function-call arguments that are not JSON objects, parallel
    calls, list outputs, custom tools, tool choices, reasoning settings, string input, and
    what SGLang refuses (shell tools, unknown item types, undeclared named tools)."""
    body: dict[str, Any] = {"model": "m", "store": False}
    if rng.random() < 0.85:
        body["instructions"] = _text(rng, rng.choice([0, 60]))
    tools: list[dict[str, Any]] = []
    if rng.random() < 0.85:
        tools = [{"type": "function", "name": t["name"], "description": t["description"],
                  "parameters": {"type": "object", **t["input_schema"]}}
                 for t in _tools(rng)]
        for tool in tools:
            if rng.random() < 0.3:
                tool["strict"] = rng.random() < 0.5
            if rng.random() < 0.1:
                del tool["description"]
        if rng.random() < 0.3:
            tools.append({"type": "custom", "name": "apply_patch",
                          "description": "Apply a patch" if rng.random() < 0.7 else None,
                          "format": rng.choice([{"type": "text"}, {
                              "type": "grammar", "syntax": "lark",
                              "definition": "start: \"*** Begin Patch\" /.+/"}])})
        if rng.random() < 0.2:
            tools.append({"type": rng.choice(["web_search", "web_search_preview",
                                              "file_search", "mcp"])})
        if rng.random() < 0.02:
            tools.append({"type": "shell"})
        body["tools"] = tools
    choice = rng.random()
    if choice < 0.1:
        body["tool_choice"] = "required"
    elif choice < 0.18:
        body["tool_choice"] = "none"
    elif choice < 0.26 and tools:
        named = rng.choice([*tools[:2], {"name": "missing"}])
        body["tool_choice"] = {"type": "function", "name": named.get("name") or "x"}
    elif choice < 0.3:
        body["tool_choice"] = {"type": "web_search_preview"}
    elif choice < 0.31:
        body["tool_choice"] = None
    effort = rng.random()
    if effort < 0.4:
        body["reasoning"] = {"effort": rng.choice(["none", "minimal", "low", "medium",
                                                    "high", "xhigh", "max"])}
    elif effort < 0.5:
        body["reasoning"] = rng.choice([{}, {"summary": "auto"}, {"effort": None}])
    if rng.random() < 0.15:
        body["chat_template_kwargs"] = rng.choice([{"enable_thinking": True},
                                                   {"thinking": False}, {"custom_flag": 1}])
    if rng.random() < 0.08:
        body["input"] = _text(rng, 12)
        return body
    items: list[dict[str, Any]] = []
    if rng.random() < 0.3:
        items.append({"type": "message", "role": "developer", "content": rng.choice([
            _text(rng, 20), [{"type": "input_text", "text": _text(rng, 20)}]])})
    if rng.random() < 0.1:
        items.append({"role": "system", "content": _text(rng, 10)})
    items.append({"role": "user", "content": rng.choice([
        _text(rng, 15), [{"type": "input_text", "text": _text(rng, 15)}]])})
    for turn in range(rng.randint(0, 9)):
        _sglang_item(rng, i, turn, items)
        if rng.random() < 0.2:
            items.append({"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": _text(rng, 5)}]})
        if rng.random() < 0.05:
            items.append({"type": "message", "role": "developer",
                          "content": "<reminder>" + _text(rng, 4)})
    if rng.random() < 0.1:
        items.append({"type": "message", "role": "assistant", "status": "in_progress",
                      "content": [{"type": "output_text", "text": "Partial"}]})
    if rng.random() < 0.02:
        items.append({"type": "item_reference", "id": "msg_x"})
    body["input"] = items
    return body


def messages_corpus(n: int = 300, seed: int = 29, *, system_role: bool = False
                    ) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [messages_request(rng, i, system_role=system_role) for i in range(n)]


def responses_corpus(n: int = 240, seed: int = 29) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [responses_request(rng, i) for i in range(n)]


def sglang_responses_corpus(n: int = 260, seed: int = 29) -> list[dict[str, Any]]:
    """The Codex-style corpus and the SGLang-specific shapes, ``n`` of those."""
    rng = random.Random(seed + 1)
    return responses_corpus() + [sglang_responses_request(rng, i) for i in range(n)]


# ---- the engines' own conversions of these corpora (tools/realengines/agent_goldens.py) ----

DATA = Path(__file__).parent / "data"


@functools.cache
def golden() -> dict[str, Any]:
    with gzip.open(DATA / "agent_apis.json.gz", "rt", encoding="utf-8") as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded


@functools.cache
def tokenizer(name: str) -> ChatTokenizer:
    return ChatTokenizer.load(DATA / "qwen3.5" if name == "qwen3.5" else None)


def prompt_or_error(make: Any) -> ChatPrompt | Exception:
    """What the engine tokenizes (its ids are ``encode_prompt`` of it, a pure function: equal
    prompts are equal ids), or the refusal."""
    try:
        result: ChatPrompt = make()
    except (ChatError, UnmodelledRequest) as exc:
        return exc
    return result




def count_mismatches(api: str, template: str, engine: str, ours: Any) -> tuple[int, int, int]:
    """``(compared, refused, mismatches)`` of ``ours(chat, body)`` (Cortex's prompt of a
    body) against the engine's conversion in the golden file: what the engine refused (or
    its converted chat the template refuses) Cortex must refuse too."""
    data = golden()
    chat = tokenizer(template)
    kind = Engine(engine)
    compared = refused = mismatches = 0
    for i, (body, theirs) in enumerate(zip(data[api], data["templates"][template][engine][api],
                                           strict=True)):
        mine = prompt_or_error(lambda b=body: ours(chat, b))
        if "error" in theirs:
            assert isinstance(mine, ChatError), (i, theirs["error"], mine)
            refused += 1
            continue
        expected = prompt_or_error(lambda t=theirs: chat.prompt(render_args(t, kind)))
        if isinstance(expected, Exception):
            assert isinstance(mine, ChatError), (i, expected)
            refused += 1
            continue
        compared += 1
        mismatches += mine != expected
        if compared % 25 == 1:  # and the ids themselves, now and then
            assert isinstance(mine, ChatPrompt) and isinstance(expected, ChatPrompt)
            assert chat.encode_prompt(mine) == chat.encode_prompt(expected)
    return compared, refused, mismatches


@functools.cache
def sglang_responses_golden() -> dict[str, Any]:
    """SGLang 0.5.23's own conversion of ``sglang_responses_corpus`` (written by
    ``tools/realengines/agent_goldens.py --sglang-responses``)."""
    with gzip.open(DATA / "sglang_responses.json.gz", "rt", encoding="utf-8") as f:
        loaded: dict[str, Any] = json.load(f)
    return loaded

