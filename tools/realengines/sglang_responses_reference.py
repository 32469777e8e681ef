"""SGLang 0.5.23's own conversion of stateless Responses bodies to chat requests, run offline.

SGLang is not installed here (no GPU). Its Responses conversion is pure Python
(``OpenAIServingResponses._construct_input_messages`` and the helpers it calls,
``_response_tools_to_chat_tools``, ``ResponsesRequest`` / ``ChatCompletionRequest``
validation), but the serving module imports the whole server (torch, the scheduler, harmony,
the tool-call parsers). So this script imports it from the wheel with those imports
replaced by empty stand-ins (:data:`STANDINS`, never called by the conversion), and
reproduces ``create_responses`` / ``_make_request`` up to the point where the chat request
goes to ``_process_messages``: the 400s checked before, then the ``ChatCompletionRequest``
built from the converted messages and tools. The server is a plain HF-template one (no
harmony / gpt-oss, no Beam tool adapter, no ``muse`` tool parser, no response store);
``supports_inline_system`` comes from SGLang's own probe
(``parser/template_detection.detect_inline_system_support``) of the template given.

Setup, once (the project's venv has pydantic, fastapi, openai, orjson, jinja2)::

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl && cd /tmp/sgl && unzip -q *.whl
    .venv/bin/python -m pip install --target /tmp/sgl-deps --no-deps msgspec

Then ``PYTHONPATH=/tmp/sgl-deps .venv/bin/python tools/realengines/sglang_responses_reference.py
/tmp/sgl`` reads ``{"responses": [body...], "templates": {name: template text | null}}`` on
stdin and writes ``{name: {"supports_inline_system": bool, "responses": [chat | {"error":
...}]}}``: per template, the chat-completion body SGLang renders for each body (``messages``
dumped without unset fields, ``tools``, ``tool_choice``, ``reasoning_effort``,
``chat_template_kwargs``), and ``template_tools``: the tool dicts ``_process_messages``
hands to the template.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import types
from typing import Any

STANDINS = (
    # third-party modules of the server the conversion never calls
    "pybase64", "IPython", "IPython.display", "openai_harmony",
    # the server around the conversion
    "sglang.srt.utils", "sglang.srt.runtime_context", "sglang.srt.managers.io_struct",
    "sglang.srt.sampling.sampling_params", "sglang.srt.entrypoints.context",
    "sglang.srt.entrypoints.harmony_utils", "sglang.srt.entrypoints.openai.serving_chat",
    "sglang.srt.entrypoints.openai.responses_tools.beam",
    "sglang.srt.entrypoints.openai.tool_server", "sglang.srt.entrypoints.openai.utils",
    "sglang.srt.function_call.core_types", "sglang.srt.function_call.function_call_parser",
    "sglang.srt.function_call.json_array_parser", "sglang.srt.parser.reasoning_parser",
    "sglang.srt.parser.response_template", "sglang.srt.arg_groups.muse_spark_hook",
    "sglang.srt.arg_groups.overrides",
)


class _StandIn(types.ModuleType):
    """A module whose every attribute is a new empty class."""

    def __getattr__(self, name: str) -> Any:
        if name == "__all__":
            return []
        if name.startswith("__"):
            raise AttributeError(name)
        made = type(name, (), {"__init__": lambda self, *args, **kwargs: None})
        setattr(self, name, made)
        return made


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name in STANDINS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _StandIn(spec.name)
        real = os.path.join(self.root, *spec.name.split("."))
        module.__path__ = [real] if os.path.isdir(real) else []  # its submodules load
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _Server:
    """The few attributes of the serving object the conversion reads."""

    def __init__(self, supports_inline_system: bool) -> None:
        self.supports_inline_system = supports_inline_system
        self.tool_call_parser = None
        self.msg_store: dict[str, Any] = {}


def _convert(serving: Any, request_cls: Any, chat_cls: Any, body: dict[str, Any]
             ) -> dict[str, Any]:
    request = request_cls.model_validate(body)
    # create_responses, before the conversion (no Beam adapter, no harmony)
    if any(tool.type == "shell" for tool in request.tools):
        raise ValueError("Shell tools are not supported by this model")
    if request.previous_response_id is not None or request.background:
        raise ValueError("Response store is disabled")
    if request.tool_choice == "required" and not any(
            tool.type in ("function", "custom") for tool in request.tools or []):
        raise ValueError('tool_choice="required" requires at least one tool')
    tool_choice = request.effective_tool_choice()
    if isinstance(tool_choice, dict) and not any(
            tool.type in ("function", "custom") and tool.name == tool_choice["name"]
            for tool in request.tools or []):
        raise ValueError(f"Tool {tool_choice['name']!r} is not declared in tools")
    # _make_request, up to _process_messages
    messages = serving._construct_input_messages(request, None)
    chat_tools = serving._response_tools_to_chat_tools(request)
    chat = chat_cls(
        model=request.model, messages=messages, stream=request.stream,
        tools=chat_tools or None,
        tool_choice=(serving._chat_tool_choice(request.effective_tool_choice())
                     if chat_tools else "none"),
        parallel_tool_calls=(request.parallel_tool_calls
                             if request.parallel_tool_calls is not None else True),
        stop=request.stop,
        reasoning_effort=request.reasoning.effort if request.reasoning else None,
        chat_template_kwargs=request.chat_template_kwargs)
    out: dict[str, Any] = {"messages": [m.model_dump(exclude_none=True) for m in chat.messages]}
    if chat.tools is not None:
        out["tools"] = [tool.model_dump() for tool in chat.tools]
    choice = chat.tool_choice
    out["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    for name in ("reasoning_effort", "chat_template_kwargs"):
        if getattr(chat, name, None) is not None:
            out[name] = getattr(chat, name)
    # what _process_messages hands the template as tools
    template_tools = None
    if chat.tools and chat.tool_choice != "none":
        if not isinstance(chat.tool_choice, str):
            template_tools = [t.model_dump() for t in chat.tools
                              if t.function.name == chat.tool_choice.function.name] or None
        else:
            template_tools = [t.model_dump() for t in chat.tools]
    out["template_tools"] = template_tools
    result: dict[str, Any] = json.loads(json.dumps(out, default=lambda o: o.model_dump()))
    return result


def main() -> None:
    root = sys.argv[1]
    sys.meta_path.insert(0, _StandIns(root))
    sys.path.insert(0, root)
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
    from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
    from sglang.srt.parser.template_detection import detect_inline_system_support

    job = json.load(sys.stdin)
    out: dict[str, Any] = {}
    for name, template in job["templates"].items():
        inline = detect_inline_system_support(template)
        server = _Server(inline)
        # the conversion's methods, bound to the stand-in server state
        serving = types.SimpleNamespace(**vars(server))
        for attr in ("_construct_input_messages", "_response_input_history",
                     "_response_tools_to_chat_tools"):
            setattr(serving, attr, getattr(OpenAIServingResponses, attr).__get__(serving))
        for attr in ("_normalize_response_message_for_chat",
                     "_merge_consecutive_assistant_messages", "_chat_tool_choice"):
            setattr(serving, attr, getattr(OpenAIServingResponses, attr))
        converted = []
        for body in job["responses"]:
            try:
                converted.append(_convert(serving, ResponsesRequest, ChatCompletionRequest,
                                          body))
            except Exception as exc:  # SGLang answers these with a 400
                converted.append({"error": f"{type(exc).__name__}: {exc}"})
        out[name] = {"supports_inline_system": inline, "responses": converted}
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
