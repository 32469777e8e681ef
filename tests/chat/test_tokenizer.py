"""Tokenizer + template loading, the engines' conversations, and the prompt token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import (
    ChatTemplate,
    ChatTokenizer,
    ContentFormat,
    RenderArgs,
    TemplateError,
    default_tokenizer_dir,
)
from cortex.hashing import Engine

ENGINES = [Engine.SGLANG, Engine.VLLM]
OPENAI_FORMAT = ("{% for m in messages %}[{{ m['role'] }}]{% for c in m['content'] %}"
                 "({{ c['text'] }}){% endfor %}{% endfor %}")
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


def sp(name: str) -> str:
    """A DeepSeek special token by its plain name (fullwidth bars, U+2581 for spaces)."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load()


def args(engine: Engine, *messages: dict[str, Any], **body: Any) -> RenderArgs:
    return RenderArgs.of(engine, list(messages), **body)


@pytest.mark.parametrize("engine", ENGINES)
def test_default_template_renders_every_role(chat: ChatTokenizer, engine: Engine) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    text = chat.render(args(engine, *messages))
    assert text.startswith(f"{sp('begin of sentence')}Be brief.{sp('User')}Weather?")
    assert f"{sp('tool call begin')}get_weather{sp('tool sep')}{{}}" in text
    assert f"{sp('tool output begin')}sunny{sp('tool output end')}{sp('tool outputs end')}" in text
    assert f"It is sunny.{sp('end of sentence')}{sp('User')}Thanks" in text
    assert text.endswith(f"{sp('Assistant')}</think>")


def test_tools_reach_the_template(chat: ChatTokenizer) -> None:
    tool = {"type": "function", "function": {"name": "lookup", "description": "Find things",
                                             "parameters": {"type": "object"}}}
    for engine in ENGINES:
        text = chat.render(args(engine, {"role": "user", "content": "x"}, tools=[tool]))
        assert '### lookup\nDescription: Find things\n\nParameters: {"type": "object"}' in text
    sglang_none = args(Engine.SGLANG, {"role": "user", "content": "x"}, tools=[tool],
                       tool_choice="none")
    assert "lookup" not in chat.render(sglang_none)


def test_bos_comes_from_the_template_once(chat: ChatTokenizer) -> None:
    for engine in ENGINES:
        ids = chat.encode_chat(args(engine, {"role": "user", "content": "Hello"}))
        assert ids[0] == chat.tokenizer.token_to_id(chat.bos_token) == 0
        assert ids.count(0) == 1
        assert ids[-2:] == [chat.tokenizer.token_to_id(sp("Assistant")),
                            chat.tokenizer.token_to_id("</think>")]
    assert chat.eos_token_id == 1
    assert chat.special_tokens["bos_token"] == sp("begin of sentence")


def test_continue_final_message_gives_the_same_prompt_on_both_engines(chat: ChatTokenizer
                                                                      ) -> None:
    messages = [{"role": "user", "content": "Write a haiku"},
                {"role": "assistant", "content": "Autumn moon, "}]
    vllm = chat.encode_chat(args(Engine.VLLM, *messages, continue_final_message=True,
                                 add_generation_prompt=False))
    sglang = chat.encode_chat(args(Engine.SGLANG, *messages, continue_final_message=True))
    assert vllm == sglang
    assert chat.decode(vllm).endswith(f"{sp('Assistant')}</think>Autumn moon, ")
    # Without it SGLang turns a trailing assistant message into a user message.
    as_user = chat.render(args(Engine.SGLANG, *messages))
    assert as_user.endswith(f"{sp('User')}Autumn moon, {sp('Assistant')}</think>")


def test_content_formats_follow_each_engine(chat: ChatTokenizer) -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}
    assert chat.content_format(Engine.VLLM) is ContentFormat.STRING
    assert chat.render(args(Engine.VLLM, parts)).endswith(f"{sp('User')}a\nb{sp('Assistant')}"
                                                          "</think>")
    assert chat.render(args(Engine.SGLANG, parts)).endswith(f"{sp('User')}a b{sp('Assistant')}"
                                                            "</think>")
    looping = chat.with_template(ChatTemplate(OPENAI_FORMAT))
    for engine in ENGINES:
        assert looping.content_format(engine) is ContentFormat.OPENAI
        assert looping.render(args(engine, parts)) == "[user](a)(b)"
    # vLLM hands a string content to a parts-looping template as one text part
    assert looping.render(args(Engine.VLLM, {"role": "user", "content": "s"})) == "[user](s)"
    media = chat.with_template(ChatTemplate("{# image #}" + PLAIN))
    assert media.content_format(Engine.SGLANG) is ContentFormat.OPENAI
    assert media.content_format(Engine.VLLM) is ContentFormat.STRING


def test_other_template_changes_the_tokens(tmp_path: Path, chat: ChatTokenizer) -> None:
    path = tmp_path / "plain.jinja"
    path.write_text(PLAIN)
    other = ChatTokenizer.load(default_tokenizer_dir(), path)
    request = args(Engine.VLLM, {"role": "user", "content": "Hello"})
    assert other.render(request) == "user: Hello\n"
    assert other.encode_chat(request) != chat.encode_chat(request)
    # the engines add no special tokens to a rendered chat unless asked (vLLM only)
    assert 0 not in other.encode_chat(request)


def test_tokenizer_directory_supplies_template_and_special_tokens(tmp_path: Path) -> None:
    shutil.copy(default_tokenizer_dir() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<B>"}, "eos_token": "<E>", "unk_token": None,
        "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}"}))
    loaded = ChatTokenizer.load(tmp_path)
    request = args(Engine.SGLANG, {"role": "user", "content": "x"})
    assert loaded.render(request) == "<B>x<E>"
    assert loaded.special_tokens == {"bos_token": "<B>", "eos_token": "<E>"}
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}")
    assert ChatTokenizer.load(tmp_path).render(request) == "Jx"
    with pytest.raises(FileNotFoundError):
        ChatTokenizer.load(tmp_path / "missing")


def test_template_errors_are_client_errors(chat: ChatTokenizer) -> None:
    failing = chat.with_template(ChatTemplate("{{ raise_exception('nope') }}"))
    with pytest.raises(TemplateError, match="nope"):
        failing.encode_chat(args(Engine.VLLM, {"role": "user", "content": "x"}))


MACRO_LOOP = (
    "{%- macro show(parts) %}{%- if parts is string %}{{ parts }}{%- else %}"
    "{%- for p in parts %}({{ p.text }}){%- endfor %}{%- endif %}{%- endmacro %}"
    "{%- for message in messages %}[{{ message.role }}]{{ show(message.content) }}"
    "{%- endfor %}")


@pytest.mark.parametrize("template", [
    MACRO_LOOP,  # a macro loops over the parameter a call passes message.content
    MACRO_LOOP.replace("show(message.content)", "show(parts=message['content'])"),
    "{%- for message in messages %}{%- set content = message.content %}[{{ message.role }}]"
    "{%- for p in content %}({{ p.text }}){%- endfor %}{%- endfor %}",  # a loop over `content`
])
def test_vllm_sees_content_loops_through_macros_and_content_variables(
    chat: ChatTokenizer, template: str,
) -> None:
    """As vLLM 0.32's detection (the Qwen3.5 template renders content in a macro): the
    parts reach the template, found against a real engine (tests/realengines)."""
    parts = {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]}
    looping = chat.with_template(ChatTemplate(template))
    assert looping.content_format(Engine.VLLM) is ContentFormat.OPENAI
    assert looping.render(args(Engine.VLLM, parts)) == "[user](a)(b)"
