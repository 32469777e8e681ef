"""DeepSeek-V4's prompt format as vLLM's ``--tokenizer-mode deepseek_v4`` writes it (pure).

The DeepSeek-V4 tokenizer ships no chat template: vLLM (0.32) renders chats with the model's
own Python encoder, so :class:`DeepSeekV4Template` is a template whose rendering is code. The
rules, checked against the real engine's ``/tokenize`` (``tests/realengines``):

- the prompt starts with the begin-of-sentence token; ``add_generation_prompt`` and
  ``continue_final_message`` change nothing (the encoder ignores both): after a final user
  (or trailing system) message the Assistant token opens the answer;
- **thinking** is on unless ``thinking`` / ``enable_thinking`` (``chat_template_kwargs``)
  say otherwise, or ``reasoning_effort`` is ``"none"``. With it on, the first message is
  preceded by the reasoning-effort preamble (``high`` unless ``reasoning_effort`` asks for
  ``max``, or ``low``/``minimal``/``medium`` = none) and the answer opens with ``<think>``;
  with it off, with ``</think>``. Before the last user message, assistant reasoning and
  developer messages are dropped — unless any message carries tools;
- **tools** join the first system message (one is made when there is none) as a
  ``## Tools`` section of JSON schemas; tool calls are DSML ``tool_calls`` blocks of
  ``invoke`` / ``parameter`` elements (string arguments raw, others as JSON); tool results
  join a user turn as ``<tool_result>…</tool_result>`` blocks, in the order of the calls;
- list contents are their text parts joined by a blank line (a tool's by a newline).

Selected by the template file ``templates/deepseek_v4_vllm.jinja`` (its first line is
:data:`MARKER`): ``chat_template: <that file>`` in a model's config, or
:func:`template_from_text`. Messages' ``task`` fields (DeepSeek's internal classification
tasks) are not modelled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cortex.chat.errors import TemplateError
from cortex.chat.template import ChatTemplate

__all__ = [
    "DEEPSEEK_V4_TEMPLATE",
    "MARKER",
    "DeepSeekV4Template",
    "render_deepseek_v4",
    "template_from_text",
]

MARKER = "{#- cortex:deepseek_v4 encoder"
"""The first line of a template file that selects :class:`DeepSeekV4Template`."""

DEEPSEEK_V4_TEMPLATE = Path(__file__).with_name("templates") / "deepseek_v4_vllm.jinja"

BOS, EOS = "<\uff5cbegin▁of▁sentence\uff5c>", "<\uff5cend▁of▁sentence\uff5c>"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
THINK, END_THINK = "<think>", "</think>"
DSML = "\uff5cDSML\uff5c"

EFFORT_PREAMBLES = {
    "low": "",
    "high": (
        "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
        "You MUST be very thorough in your thinking and comprehensively decompose the problem"
        " to resolve the root cause, rigorously stress-testing your logic against all"
        " potential paths, edge cases, and adversarial scenarios.\n"
        "Explicitly write out your entire deliberation process, documenting every"
        " intermediate step, considered alternative, and rejected hypothesis to ensure"
        " absolutely no assumption is left unchecked.\n\n"),
    "max": (
        "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
        "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to"
        " chance: exhaustively decompose the problem into its most fundamental components,"
        " trace every causal chain to its root, and resolve the underlying cause rather than"
        " any surface symptom.\n"
        "Do not stop reasoning until you have independently verified the solution from"
        " multiple angles and are certain that no assumption remains unchecked and no error"
        " remains undiscovered.\n\n"),
}

TOOLS_SECTION = f"""## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools \
by writing a "<{DSML}tool_calls>" block like the following:

<{DSML}tool_calls>
<{DSML}invoke name="$TOOL_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{DSML}parameter>
...
</{DSML}invoke>
<{DSML}invoke name="$TOOL_NAME2">
...
</{DSML}invoke>
</{DSML}tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types \
(numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK}), you MUST output your complete reasoning \
inside {THINK}...{END_THINK} BEFORE any tool calls or final response.

Otherwise, output directly after {END_THINK} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool \
calls.
"""

Message = dict[str, Any]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _text(content: Any, joiner: str = "\n\n") -> str:
    """A content as text: a string, or its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return joiner.join(str(part.get("text", "")) for part in content
                       if isinstance(part, Mapping) and part.get("type") == "text")


def _mode(variables: Mapping[str, Any]) -> tuple[bool, str | None]:
    """``(thinking, reasoning effort)`` from the template variables."""
    thinking = True
    if "thinking" in variables or "enable_thinking" in variables:
        thinking = bool(variables.get("thinking")) or bool(variables.get("enable_thinking"))
    effort = variables.get("reasoning_effort")
    if not isinstance(effort, str):
        return thinking, "high" if thinking else None
    if effort == "none":
        return False, None
    if effort == "max":
        return thinking, "max"
    return thinking, "low" if effort in ("low", "minimal", "medium") else "high"


def _with_tools(messages: list[Message], tools: Sequence[Mapping[str, Any]] | None
                ) -> list[Message]:
    if not tools:
        return messages
    at = next((i for i, m in enumerate(messages) if m.get("role") == "system"), None)
    if at is None:
        messages.insert(0, {"role": "system"})
        at = 0
    messages[at] = {**messages[at], "tools": list(tools)}
    return messages


def _merge_tool_results(messages: list[Message]) -> list[Message]:
    """Tool messages become ``tool_result`` blocks of a user turn; text that follows them
    joins that turn."""
    merged: list[Message] = []
    for message in messages:
        role = message.get("role")
        open_turn = (merged[-1] if merged and merged[-1].get("role") == "user"
                     and "blocks" in merged[-1] else None)
        if role == "tool":
            block = {"type": "tool_result", "id": message.get("tool_call_id", ""),
                     "text": _text(message.get("content"), "\n")}
            if open_turn is not None:
                open_turn["blocks"].append(block)
            else:
                merged.append({"role": "user", "blocks": [block]})
        elif role == "user":
            text = _text(message.get("content"))
            if open_turn is not None:
                open_turn["blocks"].append({"type": "text", "text": text})
            else:
                merged.append({**message, "content": text,
                               "blocks": [{"type": "text", "text": text}]})
        else:
            merged.append(dict(message))
    _order_tool_results(merged)
    return merged


def _order_tool_results(messages: list[Message]) -> None:
    """A user turn's tool results in the order of the last assistant turn's calls."""
    order: dict[str, int] = {}
    for message in messages:
        if message.get("role") == "assistant" and message.get("tool_calls"):
            order = {}
            for i, call in enumerate(message["tool_calls"]):
                if call.get("id"):
                    order[call["id"]] = i
        elif message.get("role") == "user" and order:
            blocks = message.get("blocks", [])
            results = iter(sorted((b for b in blocks if b["type"] == "tool_result"),
                                  key=lambda b: order.get(b["id"], 0)))
            message["blocks"] = [next(results) if b["type"] == "tool_result" else b
                                 for b in blocks]


def _last_user(messages: Sequence[Message]) -> int:
    return next((i for i in range(len(messages) - 1, -1, -1)
                 if messages[i].get("role") in ("user", "developer")), -1)


def _drop_thinking(messages: list[Message]) -> list[Message]:
    """Before the last user message: assistant reasoning and developer messages go."""
    last = _last_user(messages)
    kept: list[Message] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role in ("user", "system", "tool") or i >= last:
            kept.append(message)
        elif role == "assistant":
            kept.append({k: v for k, v in message.items() if k != "reasoning"})
    return kept


def _tools_section(tools: Sequence[Mapping[str, Any]]) -> str:
    schemas = "\n".join(_json(tool["function"]) for tool in tools)
    return TOOLS_SECTION.replace("{schemas}", schemas)


def _tool_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    invokes = []
    for call in calls:
        function = call["function"]
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise TemplateError(f"tool call arguments are not JSON: {exc}") from exc
        params = "\n".join(
            f'<{DSML}parameter name="{key}" string="{str(isinstance(value, str)).lower()}">'
            f'{value if isinstance(value, str) else _json(value)}</{DSML}parameter>'
            for key, value in dict(arguments or {}).items())
        invokes.append(f'<{DSML}invoke name="{function.get("name")}">\n{params}\n</{DSML}invoke>')
    body = "\n".join(invokes)
    return f"\n\n<{DSML}tool_calls>\n{body}\n</{DSML}tool_calls>"


def _user_turn(message: Message) -> str:
    parts = [f"<tool_result>{b['text']}</tool_result>" if b["type"] == "tool_result"
             else b["text"] for b in message.get("blocks", [])]
    return USER + ("\n\n".join(parts) if parts else _text(message.get("content")))


def _body(message: Message, index: int, last_user: int, thinking: bool, drop: bool) -> str:
    """One message without what opens the next turn."""
    role = message.get("role")
    content = _text(message.get("content"))
    tools = message.get("tools")
    if role == "system":
        return content + ("\n\n" + _tools_section(tools) if tools else "")
    if role == "developer":
        if not content:
            raise TemplateError("a developer message needs content")
        return USER + content + ("\n\n" + _tools_section(tools) if tools else "")
    if role == "user":
        return _user_turn(message)
    if role == "assistant":
        reasoning = ""
        if thinking and (not drop or index > last_user):
            reasoning = str(message.get("reasoning") or "") + END_THINK
        calls = _tool_calls(message["tool_calls"]) if message.get("tool_calls") else ""
        return reasoning + content + calls + EOS
    raise TemplateError(f"DeepSeek-V4 has no role {role!r}")


def render_deepseek_v4(messages: Sequence[Mapping[str, Any]],
                       tools: Sequence[Mapping[str, Any]] | None,
                       variables: Mapping[str, Any]) -> str:
    """The prompt text vLLM's ``deepseek_v4`` encoder writes. Raises ``TemplateError``."""
    thinking, effort = _mode(variables)
    chat = _merge_tool_results(_with_tools([dict(m) for m in messages], tools))
    drop = bool(variables.get("drop_thinking", True)) and not any(m.get("tools") for m in chat)
    if thinking and drop:
        chat = _drop_thinking(chat)
    last_user = _last_user(chat)
    out = [BOS]
    for i, message in enumerate(chat):
        if i == 0 and thinking:
            out.append(EFFORT_PREAMBLES[effort or "low"])
        out.append(_body(message, i, last_user, thinking, drop))
        following = chat[i + 1].get("role") if i + 1 < len(chat) else None
        role = message.get("role")
        if following not in (None, "assistant"):
            continue
        if role in ("user", "developer", "system"):
            opens_thinking = thinking and (not drop or i >= last_user)
            out.append(ASSISTANT + (THINK if opens_thinking else END_THINK))
    return "".join(out)


class DeepSeekV4Template(ChatTemplate):
    """A chat template rendered by :func:`render_deepseek_v4` (its Jinja text is only read
    for the content format: it loops over contents, as vLLM hands this encoder parts)."""

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = False, continue_final_message: bool = False,
               variables: Mapping[str, Any] | None = None) -> str:
        return render_deepseek_v4(messages, tools, variables or {})


def template_from_text(text: str) -> ChatTemplate:
    """A Jinja chat template, or the DeepSeek-V4 encoder when ``text`` starts with
    :data:`MARKER`."""
    return DeepSeekV4Template(text) if text.startswith(MARKER) else ChatTemplate(text)
