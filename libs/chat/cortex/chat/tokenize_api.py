"""The engines' ``POST /tokenize`` and ``POST /detokenize`` bodies, read and answered (pure).

Served by the gateway and the simulated engine alike, in the shapes of the engine kind, so
that ``diff <(curl gateway/tokenize) <(curl engine/tokenize)`` shows only real differences:

- **vLLM** (``vllm/entrypoints/serve/tokenize``): ``{"prompt": str, "add_special_tokens":
  true}`` or ``{"messages": [...], "add_generation_prompt": true, "continue_final_message":
  false, "add_special_tokens": false, "chat_template_kwargs", "tools"}`` (a request
  ``chat_template`` is refused), optional ``return_token_strs`` → ``{"count", "max_model_len",
  "tokens", "token_strs"}``; ``{"tokens": [int]}`` → ``{"prompt": str}`` (special tokens kept).
- **SGLang** (``serving_tokenize.py``): ``{"prompt": str | [str], "add_special_tokens": true}``
  or ``{"messages": [...]}`` rendered exactly as a chat completion (``tools``,
  ``tool_choice``, ``reasoning_effort``, ``continue_final_message``, ``chat_template_kwargs``)
  → ``{"tokens", "count", "max_model_len"}`` (lists for a list of prompts);
  ``{"tokens": [int] | [[int]], "skip_special_tokens": true}`` → ``{"text": str | [str]}``.

Raises :class:`~cortex.chat.errors.InvalidChatRequest` for what the engine answers 400.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cortex.chat.request import (  # the same field checks as chat bodies
    RenderArgs,
    _flag,
    _invalid,
    render_args,
)
from cortex.hashing import Engine

__all__ = ["DetokenizeQuery", "TokenizeQuery", "detokenize_query", "detokenize_response",
           "tokenize_query", "tokenize_response"]

_VLLM_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                     "add_special_tokens", "chat_template", "chat_template_kwargs", "tools")
_MAX_TOKEN_ID = 2**32 - 1


@dataclass(frozen=True, slots=True)
class TokenizeQuery:
    """What to tokenize: a chat (``chat``) or prompt texts (``texts``, each with
    ``add_special_tokens``); ``batched``: the answer holds one list per text (SGLang);
    ``token_strs``: vLLM's ``return_token_strs``."""

    engine: Engine
    chat: RenderArgs | None = None
    texts: tuple[str, ...] = ()
    add_special_tokens: bool = True
    batched: bool = False
    token_strs: bool = False


@dataclass(frozen=True, slots=True)
class DetokenizeQuery:
    """Token id lists to decode; ``batched``: answer a list (SGLang)."""

    engine: Engine
    tokens: tuple[tuple[int, ...], ...]
    batched: bool = False
    skip_special_tokens: bool = False


def tokenize_query(body: Mapping[str, Any], engine: Engine) -> TokenizeQuery:
    """Read a ``/tokenize`` body the way ``engine`` does."""
    engine = Engine(engine)
    has_messages = body.get("messages") is not None
    has_prompt = body.get("prompt") is not None
    if has_messages == has_prompt:
        raise _invalid("exactly one of 'prompt' or 'messages' must be provided", "prompt")
    if engine is Engine.VLLM:
        token_strs = _flag(body, "return_token_strs", False)
        if has_messages:
            chat = {k: body[k] for k in _VLLM_CHAT_FIELDS if k in body}
            return TokenizeQuery(engine, chat=render_args(chat, engine), token_strs=token_strs)
        if not isinstance(body["prompt"], str):
            raise _invalid("'prompt' must be a string", "prompt")
        return TokenizeQuery(engine, texts=(body["prompt"],),
                             add_special_tokens=_flag(body, "add_special_tokens", True),
                             token_strs=token_strs)
    if has_messages:
        chat_body = {k: v for k, v in body.items() if k not in ("prompt", "add_special_tokens")}
        return TokenizeQuery(engine, chat=render_args(chat_body, engine))
    prompt = body["prompt"]
    special = _flag(body, "add_special_tokens", True)
    if isinstance(prompt, str):
        return TokenizeQuery(engine, texts=(prompt,), add_special_tokens=special)
    if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        return TokenizeQuery(engine, texts=tuple(prompt), add_special_tokens=special,
                             batched=True)
    raise _invalid("'prompt' must be a string or a list of strings", "prompt")


def tokenize_response(query: TokenizeQuery, ids: Sequence[list[int]], max_model_len: int,
                      token_strs: Sequence[list[str]] | None = None) -> dict[str, Any]:
    """The engine's answer for ``ids`` (one list per text, or one for a chat)."""
    if query.engine is Engine.VLLM:
        tokens = ids[0]
        return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                "token_strs": token_strs[0] if token_strs is not None else None}
    if query.batched:
        return {"tokens": list(ids), "count": [len(t) for t in ids],
                "max_model_len": max_model_len}
    return {"tokens": ids[0], "count": len(ids[0]), "max_model_len": max_model_len}


def _token_ids(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_TOKEN_ID
            for t in value):
        raise _invalid("'tokens' must be a list of token ids", "tokens")
    return tuple(value)


def detokenize_query(body: Mapping[str, Any], engine: Engine) -> DetokenizeQuery:
    """Read a ``/detokenize`` body the way ``engine`` does."""
    engine = Engine(engine)
    tokens = body.get("tokens")
    if engine is Engine.SGLANG:
        skip = _flag(body, "skip_special_tokens", True)
        if isinstance(tokens, list) and tokens and all(isinstance(t, list) for t in tokens):
            return DetokenizeQuery(engine, tuple(_token_ids(t) for t in tokens), True, skip)
        return DetokenizeQuery(engine, (_token_ids(tokens),), False, skip)
    return DetokenizeQuery(engine, (_token_ids(tokens),))


def detokenize_response(query: DetokenizeQuery, texts: Sequence[str]) -> dict[str, Any]:
    """The engine's answer for the decoded ``texts`` (one per token list)."""
    if query.engine is Engine.VLLM:
        return {"prompt": texts[0]}
    return {"text": list(texts) if query.batched else texts[0]}
