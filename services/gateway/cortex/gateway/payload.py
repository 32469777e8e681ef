"""Request bodies → validated :class:`InferenceRequest` (pure; raises :class:`ClientError`).

Validation is deliberately shallow where the engine is the authority (sampling parameters
are forwarded untouched) and strict where the gateway acts on a field: the model, the prompt
it must tokenize exactly as the engine will, ``stream`` / ``stream_options`` it rewrites, and
the prompt length limit. Chat rendering arguments are the engine's own reading of the body
(:func:`cortex.chat.render_args` for the model's engine kind), and so is whether a text
prompt gets the tokenizer's special tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from cortex.chat import ChatError, RenderArgs, render_args, text_add_special_tokens
from cortex.gateway.config import GatewayConfig, ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode

__all__ = ["Endpoint", "InferenceRequest", "Prompt", "parse_body", "parse_request"]

_MAX_TOKEN_ID = 2**32 - 1


class Endpoint(StrEnum):
    """The inference endpoints (the upstream path is the same)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    GENERATE = "/generate"


class PromptKind(StrEnum):
    CHAT = "chat"  # messages to render with the chat template
    TEXT = "text"  # plain text, tokenized with the tokenizer's special tokens
    TOKENS = "tokens"  # token ids given by the client


@dataclass(frozen=True, slots=True)
class Prompt:
    """The first prompt of the request (batches route on it): what to tokenize and how.

    ``chat``: the chat rendering arguments; ``add_special_tokens``: whether a text prompt
    gets the tokenizer's special tokens."""

    kind: PromptKind
    chat: RenderArgs | None = None
    text: str = ""
    add_special_tokens: bool = True
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """A validated inference request. ``body`` is the client's JSON object (forwarded, with
    ``stream_options`` adjusted upstream); ``wants_usage``: the client asked for the usage
    chunk itself; ``lora_name`` / ``cache_salt`` extend the hash chain's root."""

    endpoint: Endpoint
    model: ModelConfig
    body: dict[str, Any]
    prompt: Prompt
    stream: bool
    wants_usage: bool
    lora_name: str | None = None
    cache_salt: str | None = None


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ClientError("request body is not valid JSON", code=ErrorCode.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise ClientError("request body must be a JSON object", code=ErrorCode.INVALID_JSON)
    return body


def _invalid(message: str, param: str) -> ClientError:
    return ClientError(message, code=ErrorCode.INVALID_REQUEST, param=param)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(f"'{name}' must be a boolean", name)
    return value


def _count(body: Mapping[str, Any], name: str, minimum: int) -> None:
    value = body.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or value < minimum):
        raise _invalid(f"'{name}' must be an integer >= {minimum}", name)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _invalid(f"'{name}' must be a string", name)
    return value or None


def _model(body: Mapping[str, Any], config: GatewayConfig, required: bool) -> ModelConfig:
    name = body.get("model")
    if name is None and not required:
        return config.models[0]
    if not isinstance(name, str) or not name:
        raise _invalid("'model' is required and must be a string", "model")
    model = config.model(name)
    if model is None:
        raise ClientError(f"model '{name}' is not served here", code=ErrorCode.MODEL_NOT_FOUND,
                          status=404, param="model")
    return model


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _invalid(f"'{name}' must be a non-empty list of token ids", name)
    for token in value:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= _MAX_TOKEN_ID:
            raise _invalid(f"'{name}' holds an invalid token id", name)
    return tuple(value)


def _text_or_tokens(value: Any, name: str, add_special_tokens: bool = True) -> Prompt:
    """``str | [str] | [int] | [[int]]``; a batch routes on its first prompt."""
    if isinstance(value, str):
        return Prompt(PromptKind.TEXT, text=value, add_special_tokens=add_special_tokens)
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return Prompt(PromptKind.TEXT, text=value[0], add_special_tokens=add_special_tokens)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return Prompt(PromptKind.TOKENS, token_ids=_token_ids(value, name))
        if all(isinstance(p, list) for p in value):
            ids = [_token_ids(p, name) for p in value]
            return Prompt(PromptKind.TOKENS, token_ids=ids[0])
    raise _invalid(
        f"'{name}' must be a string, a list of strings, a list of token ids or a list of "
        "token id lists", name)


def _chat(body: Mapping[str, Any], model: ModelConfig) -> Prompt:
    try:
        args = render_args(body, model.engine)
    except ChatError as exc:
        raise _invalid(str(exc), exc.param) from None
    return Prompt(PromptKind.CHAT, chat=args)


def _special_tokens(body: Mapping[str, Any], model: ModelConfig) -> bool:
    try:
        return text_add_special_tokens(body, model.engine)
    except ChatError as exc:
        raise _invalid(str(exc), exc.param) from None


def parse_request(endpoint: Endpoint, body: dict[str, Any], config: GatewayConfig
                  ) -> InferenceRequest:
    """Validate a decoded body for ``endpoint``; raises :class:`ClientError`."""
    model = _model(body, config, required=endpoint is not Endpoint.GENERATE)
    if endpoint is Endpoint.CHAT:
        prompt = _chat(body, model)
        _count(body, "max_completion_tokens", 0)
    elif endpoint is Endpoint.COMPLETIONS:
        prompt = _text_or_tokens(body.get("prompt"), "prompt", _special_tokens(body, model))
    elif body.get("input_ids") is not None:
        prompt = _text_or_tokens(body["input_ids"], "input_ids")
        if prompt.kind is not PromptKind.TOKENS:
            raise _invalid("'input_ids' must hold token ids", "input_ids")
    elif body.get("text") is not None:
        prompt = _text_or_tokens(body["text"], "text")
        if prompt.kind is not PromptKind.TEXT:
            raise _invalid("'text' must be a string or a list of strings", "text")
    else:
        raise _invalid("either 'text' or 'input_ids' is required", "text")
    _count(body, "max_tokens", 0)
    _count(body, "n", 1)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    return InferenceRequest(
        endpoint=endpoint,
        model=model,
        body=body,
        prompt=prompt,
        stream=stream,
        wants_usage=wants_usage,
        lora_name=_optional_str(body, "lora_path") or _optional_str(body, "lora_name"),
        cache_salt=_optional_str(body, "cache_salt"),
    )
