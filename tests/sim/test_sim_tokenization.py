"""The default tokenizer and chat template shared with the gateway."""

from __future__ import annotations

from typing import Any

import pytest

from cortex.sim.tokenization import (
    ChatTokenizer,
    TemplateError,
    default_tokenizer_dir,
    load_chat_template,
    render_chat,
)


def sp(name: str) -> str:
    """A DeepSeek special token by its plain name (fullwidth bars, U+2581 for spaces)."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load()


def test_default_template_renders_every_role(chat: ChatTokenizer) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
    ]
    text = chat.render(messages)
    assert text.startswith(f"{sp('begin of sentence')}Be brief.{sp('User')}Weather?")
    assert f"{sp('tool call begin')}get_weather{sp('tool sep')}{{}}" in text
    assert f"{sp('tool output begin')}sunny{sp('tool output end')}{sp('tool outputs end')}" in text
    assert f"It is sunny.{sp('end of sentence')}{sp('User')}Thanks" in text
    assert text.endswith(f"{sp('Assistant')}</think>")
    assert not chat.render(messages, add_generation_prompt=False).endswith("</think>")


def test_bos_comes_from_the_template_once(chat: ChatTokenizer) -> None:
    ids = chat.encode_chat([{"role": "user", "content": "Hello"}])
    assert ids[0] == chat.tokenizer.token_to_id(chat.bos_token) == 0
    assert ids.count(0) == 1
    assert ids[-2:] == [chat.tokenizer.token_to_id(sp("Assistant")),
                        chat.tokenizer.token_to_id("</think>")]
    assert chat.eos_token_id == 1


def test_other_template_for_misalignment_tests(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "plain.jinja"  # type: ignore[operator]
    path.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    other = ChatTokenizer.load(default_tokenizer_dir(), path)
    default = ChatTokenizer.load()
    messages = [{"role": "user", "content": "Hello"}]
    assert other.render(messages) == "user: Hello\n"
    assert other.encode_chat(messages) != default.encode_chat(messages)


def test_template_errors_are_client_errors() -> None:
    with pytest.raises(TemplateError):
        render_chat("{{ raise_exception('nope') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError):
        render_chat(load_chat_template(), [{"content": "no role"}])
