"""Jinja chat templates with Hugging Face ``apply_chat_template`` semantics (pure).

What both engines do through ``transformers`` (5.x, what current releases install): a
sandboxed, immutable Jinja environment with ``trim_blocks`` / ``lstrip_blocks`` and
``loopcontrols``; a ``tojson`` filter that does not HTML-escape (``ensure_ascii=False``,
optional ``indent`` / ``separators`` / ``sort_keys``); the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace``; the ``{% generation %}`` block; messages
without their ``None``-valued keys and with reasoning under all its names
(``reasoning_content``, ``thinking``); the variables ``messages``, ``tools``, ``documents``
(``None`` when absent, never undefined), ``add_generation_prompt`` and any extra variable
(special tokens, ``chat_template_kwargs``); and ``continue_final_message``, which marks
the final message's content and cuts the rendered text at the mark so the model continues
it.
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from cortex.chat.errors import TemplateError

__all__ = ["DEFAULT_CHAT_TEMPLATE", "ChatTemplate", "load_chat_template"]

DEFAULT_CHAT_TEMPLATE = Path(__file__).with_name("templates") / "deepseek_v4.jinja"
"""The default chat template file (DeepSeek-V3.1/V4 conversation format), package data."""

_RENDER_ARGS = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers' marker, cut off after rendering
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def load_chat_template(path: str | Path | None = None) -> str:
    """Read a Jinja chat template file; ``None`` reads the default one.

    A ``.json`` file is read as a ``tokenizer_config.json`` (see :func:`config_template`).
    Raises ``OSError`` / ``ValueError``.
    """
    file = DEFAULT_CHAT_TEMPLATE if path is None else Path(path)
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        template = config_template(json.loads(text))
        if template is None:
            raise ValueError(f"{file} has no 'chat_template'")
        return template
    return text


def config_template(config: Mapping[str, Any]) -> str | None:
    """The ``chat_template`` of a ``tokenizer_config.json``: a string, or from a list of
    named templates the one named ``default`` (what ``transformers`` picks without tools)."""
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and item.get("name") == "default":
                template = item.get("template")
                return template if isinstance(template, str) else None
    return None


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (assistant-mask tracking): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` for templates, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` refusing underscore-prefixed attributes (as ``transformers``)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}.")


class _Sandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, its attribute check remembered per (type, attribute).

    The check (``is_internal_attribute``, ``modifies_known_mutable``, the underscore rule)
    reads nothing but the attribute's name and the object's type, so its verdict for a pair
    never changes; computing it again cost about half of a chat template's render (every
    ``loop.index``, ``content.strip`` or ``message.get``). The pairs are the template's
    attribute names times the types it meets: a few dozen; past ``_SAFE_PAIRS`` nothing
    more is remembered."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._safe: dict[tuple[type, str], bool] = {}

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        found = self._safe.get(key)
        if found is None:
            found = super().is_safe_attribute(obj, attr, value)
            if len(self._safe) < _SAFE_PAIRS:
                self._safe[key] = found
        return found


_SAFE_PAIRS = 4096


@functools.cache
def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _Sandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@functools.lru_cache(maxsize=16)
def _compiled(text: str) -> tuple[jinja2.Template, jinja2.nodes.Template]:
    env = _environment()
    try:
        return env.from_string(text), env.parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not compile: {exc}") from exc


def _plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``transformers``' message normalization: ``None``-valued keys dropped, reasoning
    copied to ``thinking`` (first) and ``reasoning_content``."""
    out: list[dict[str, Any]] = []
    for message in messages:
        plain = {key: value for key, value in message.items() if value is not None}
        reasoning = next((plain[key] for key in _REASONING_FIELDS if key in plain), None)
        if reasoning is not None:
            plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
        out.append(plain)
    return out


def _mark_final(chat: list[dict[str, Any]], template_text: str) -> str:
    """Append the continuation marker to the final message's content (the last text part of
    a list); returns that content as it was. Raises :class:`TemplateError`."""
    if not chat:
        raise TemplateError("continue_final_message is set but the conversation is empty!")
    final = chat[-1].get("content")
    if final is None:
        raise TemplateError('continue_final_message is set but the final message has no '
                            '"content" to continue!')
    if "content" not in template_text:
        raise TemplateError('continue_final_message is set to "content" but this is not an '
                            "accepted field in the chat_template")
    last = copy.deepcopy(chat[-1])
    if isinstance(final, list | tuple):
        for block in reversed(last["content"]):
            if isinstance(block, dict) and "text" in block:
                final = block["text"]
                block["text"] = block["text"] + _CONTINUE_TAG
                break
        else:
            raise TemplateError("continue_final_message is set but we could not find any text "
                                "to continue in the final message!")
    else:
        last["content"] = final + _CONTINUE_TAG
    if not isinstance(final, str):
        raise TemplateError("continue_final_message is set but the final message has no text")
    chat[-1] = last
    return final


def _cut_at_mark(rendered: str, final: str) -> str:
    """End the text where the final message's content ended (trailing spaces the template
    trimmed stay trimmed)."""
    mark = _CONTINUE_TAG.strip()
    if final.strip() not in rendered or mark not in rendered:
        raise TemplateError("continue_final_message is set but the final message does not "
                            "appear in the chat after applying the chat template!")
    at = rendered.rindex(mark)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()


class ChatTemplate:
    """One compiled chat template. ``ValueError`` when the text does not compile."""

    def __init__(self, text: str) -> None:
        self.text = text
        self._template, self.parsed = _compiled(text)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        variables: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text (``apply_chat_template(tokenize=False)``).

        ``variables`` are further template variables (special tokens first, then the
        request's ``chat_template_kwargs``). Raises :class:`TemplateError`.
        """
        variables = variables or {}
        if continue_final_message and add_generation_prompt:
            raise TemplateError("continue_final_message and add_generation_prompt are not "
                                "compatible")
        clash = _RENDER_ARGS & variables.keys()
        if clash:
            raise TemplateError(f"got multiple values for {sorted(clash)}",
                                param="chat_template_kwargs")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TemplateError("tools should be JSON schemas (objects)", param="tools")
        if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
            raise TemplateError("Documents should be a list of dicts with 'title' and 'text' "
                                "keys!", param="documents")
        chat = _plain_messages(messages)
        final = _mark_final(chat, self.text) if continue_final_message else ""
        try:
            text = self._template.render(
                messages=chat,
                tools=None if tools is None else list(tools),
                documents=None if documents is None else list(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except TemplateError:
            raise
        except Exception as exc:  # any failure inside the template is the request's fault
            raise TemplateError(f"chat template failed: {exc}") from exc
        if continue_final_message:
            text = _cut_at_mark(text, final)
        return text

    def __repr__(self) -> str:
        first = self.text.strip().splitlines()[0][:60] if self.text.strip() else ""
        return f"ChatTemplate({len(self.text)} chars, {first!r})"
