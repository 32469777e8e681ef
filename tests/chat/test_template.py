"""Chat templates render with Hugging Face ``apply_chat_template`` semantics."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from cortex.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate, TemplateError, load_chat_template

USER = [{"role": "user", "content": "Hello"}]


def render(text: str, messages: list[dict[str, Any]] = USER, **kwargs: Any) -> str:
    return ChatTemplate(text).render(messages, **kwargs)


def test_hf_environment_filters_globals_and_variables() -> None:
    text = ("{{ messages[0]['content'] | tojson }}"
            "|{{ {'b': 1, 'a': '<é>'} | tojson(sort_keys=True) }}"
            "|{{ tools is none }}|{{ documents is none }}|{{ add_generation_prompt }}"
            "|{{ strftime_now('%Y') | length }}|{{ extra }}"
            "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}x{% endfor %}"
            "{% generation %}G{% endgeneration %}")
    out = render(text, [{"role": "user", "content": "<b>&"}], add_generation_prompt=True,
                 variables={"extra": "E"})
    assert out == '"<b>&"|{"a": "<é>", "b": 1}|True|True|True|4|EG'
    assert render("{{ tools | length }}", tools=[{"type": "function"}]) == "1"


def test_trim_and_lstrip_blocks() -> None:
    assert render("  {% if true %}\nA\n  {% endif %}\nB") == "A\nB"


def test_errors_are_template_errors() -> None:
    with pytest.raises(TemplateError, match="nope"):
        render("{{ raise_exception('nope') }}")
    with pytest.raises(TemplateError):
        render("{{ messages[5]['content'].upper() }}")
    with pytest.raises(TemplateError) as caught:
        render("x", variables={"messages": []})
    assert caught.value.param == "chat_template_kwargs"
    with pytest.raises(TemplateError, match="not compatible"):
        render("x", add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% if %}")


def test_continue_final_message_cuts_after_the_final_content() -> None:
    text = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    assert render(text, messages, continue_final_message=True) == "<user>Hi</s><assistant>Sure, "
    trimming = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
    assert render(trimming, messages, continue_final_message=True) == "<user>Hi</s><assistant>Sure,"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "Go on"}]}]
    assert render("{{ messages[0]['content'][0]['text'] }}!", parts,
                  continue_final_message=True) == "Go on"
    with pytest.raises(TemplateError, match="does not appear"):
        render("{# content #}nothing", messages, continue_final_message=True)
    with pytest.raises(TemplateError, match="not an accepted field"):
        render("nothing", messages, continue_final_message=True)


def test_messages_as_transformers_passes_them() -> None:
    """``None``-valued keys are dropped; reasoning is seen under every name."""
    text = ("{% for m in messages %}{{ m | tojson }}{% endfor %}"
            "{% set ns = namespace(n=1) %}{{ ns.n }}{{ dict(a=1) | tojson }}")
    messages = [{"role": "assistant", "content": None, "reasoning": "r", "tool_calls": None}]
    assert render(text, messages) == ('{"thinking": "r", "role": "assistant", "reasoning": "r", '
                                      '"reasoning_content": "r"}1{"a": 1}')
    with pytest.raises(TemplateError):
        render("{% set ns = namespace(_x=1) %}")


def test_template_files_and_tokenizer_configs(tmp_path: Path) -> None:
    assert load_chat_template() == DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8")
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}))
    assert load_chat_template(config) == "D"
    config.write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(ValueError, match="no 'chat_template'"):
        load_chat_template(config)


def test_template_files_are_package_data() -> None:
    """A non-editable install ships the templates: they sit in a package (a directory with an
    ``__init__.py``) and match the package-data globs of the chat library's pyproject."""
    root = Path(__file__).resolve().parents[2]
    pyproject = tomllib.loads((root / "libs/chat/pyproject.toml").read_text(encoding="utf-8"))
    patterns = pyproject["tool"]["setuptools"]["package-data"]["*"]
    templates = DEFAULT_CHAT_TEMPLATE.parent
    assert (templates / "__init__.py").is_file()
    shipped = {path for pattern in patterns for path in templates.glob(pattern)}
    assert DEFAULT_CHAT_TEMPLATE in shipped
    assert {p for p in templates.iterdir() if p.suffix != ".py"} <= shipped


def test_the_sandbox_still_refuses_what_it_refused_once_its_verdicts_are_remembered() -> None:
    # the same (type, attribute) pairs, asked twice: allowed twice, refused twice
    safe = "{{ messages[0]['content'].upper() }}{% for m in messages %}{{ loop.index }}{% endfor %}"
    for _ in range(2):
        assert render(safe) == "HELLO1"
        with pytest.raises(TemplateError):
            render("{{ messages[0]['content'].__class__.__mro__ }}")
        with pytest.raises(TemplateError):  # immutable: a list's append is refused
            render("{% set xs = [] %}{{ xs.append(1) }}")
        assert render("{{ raise_exception.__globals__ }}") == ""  # internal: undefined


def test_remembered_sandbox_verdicts_equal_jinjas_for_every_type_and_attribute() -> None:
    import jinja2.sandbox

    from cortex.chat.template import _Sandbox

    class Holder:  # a plain object whose attributes share names with unsafe ones
        def append(self) -> None: ...
        def mro(self) -> None: ...

    objects = [[], {}, set(), "s", Holder(), Holder, str, len, render, Holder().append]
    attrs = ["append", "mro", "update", "upper", "pop", "__class__", "_x", "__globals__",
             "__func__", "items"]
    fresh = jinja2.sandbox.ImmutableSandboxedEnvironment()
    remembered = _Sandbox()
    for _ in range(2):  # the second pass answers from memory
        for obj in objects:
            for attr in attrs:
                expected = fresh.is_safe_attribute(obj, attr, None)
                assert remembered.is_safe_attribute(obj, attr, None) == expected, (obj, attr)
    assert not remembered.is_safe_attribute(Holder, "mro", None)
    assert remembered.is_safe_attribute(Holder(), "mro", None)
