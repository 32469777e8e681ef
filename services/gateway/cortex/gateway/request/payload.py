"""Request bodies → validated :class:`InferenceRequest` (pure; raises :class:`ClientError`).

Validation is deliberately shallow where the engine is the authority (sampling parameters
are forwarded untouched) and strict where the gateway acts on a field: the model, the prompt
it must tokenize exactly as the engine will, ``stream`` / ``stream_options`` it rewrites, and
the model's bounds (:mod:`cortex.gateway.request.limits`: message count, prompt length, requested
completion tokens), checked before any tokenizing. Chat rendering arguments are the
engine's own reading of the body (:func:`cortex.chat.render_args` for the model's engine
kind), and so is whether a text prompt gets the tokenizer's special tokens.

A body must be UTF-8 JSON without lone surrogates (``"\\ud800"``: no tokenizer can encode
them) nested less deeply than Python's recursion limit; anything else is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cortex.chat import ChatError, RenderArgs, render_args, text_add_special_tokens
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.http import json_codec
from cortex.gateway.request.limits import Limits, precheck

__all__ = ["InferencePath", "InferenceRequest", "Prompt", "parse_body", "parse_request"]

_MAX_TOKEN_ID = 2**32 - 1
_MAX_COUNT = 2**31 - 1  # counts beyond int32 are no request any engine can serve
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class InferencePath(StrEnum):
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
    chunk itself; ``lora_name`` / ``cache_salt`` extend the hash chain's root (an ``adapter``
    named as ``model`` is the ``lora_name``); ``limits``:
    the model's bounds the request was checked against (again once it is tokenized)."""

    endpoint: InferencePath
    model: ModelConfig
    body: dict[str, Any]
    prompt: Prompt
    stream: bool
    wants_usage: bool
    lora_name: str | None = None
    cache_salt: str | None = None
    limits: Limits = field(default_factory=Limits)
    adapter: str | None = None
    """The LoRA adapter named as ``model`` (``model`` is then its base model's config)."""

    @property
    def prompt_param(self) -> str:
        """The field holding the prompt (where a length error points)."""
        if self.endpoint is InferencePath.CHAT:
            return "messages"
        if self.endpoint is InferencePath.COMPLETIONS:
            return "prompt"
        return "input_ids" if self.prompt.kind is PromptKind.TOKENS else "text"


def _bad_json(message: str) -> ClientError:
    return ClientError(message, code=ErrorCode.INVALID_JSON)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (strict UTF-8, no lone surrogates)."""
    try:  # the C codec takes only what is valid; the rest is parsed again to say why not
        body = json_codec.loads(raw)
    except json_codec.JSONDecodeError:
        body = _parse_invalid(raw)
    if not isinstance(body, dict):
        raise _bad_json("request body must be a JSON object")
    return body


def _parse_invalid(raw: bytes) -> Any:
    """Why a body the C codec refused is not valid (a :class:`ClientError`), or its value
    where the standard library takes what the C codec did not."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise _bad_json("request body is not valid UTF-8") from None
    except RecursionError:
        raise _bad_json("request body is nested too deeply") from None
    except ValueError:
        raise _bad_json("request body is not valid JSON") from None
    if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
        raise _bad_json("request body holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                        "escape without its pair)")
    return body


def _holds_lone_surrogate(obj: Any) -> bool:
    """Whether a string anywhere in ``obj`` (keys too) holds a surrogate code point; JSON
    decoding joins escaped pairs, so one left is alone. Iterative: any depth."""
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _invalid(message: str, param: str) -> ClientError:
    return ClientError(message, code=ErrorCode.INVALID_REQUEST, param=param)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(f"'{name}' must be a boolean", name)
    return value


def _count(body: Mapping[str, Any], name: str, minimum: int, where: str = "") -> None:
    value = body.get(name)
    param = f"{where}{name}"
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not minimum <= value <= _MAX_COUNT):
        raise _invalid(f"'{param}' must be an integer in {minimum}..{_MAX_COUNT}", param)


def _optional_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise _invalid(f"'{name}' must be a string", name)
    return value or None


def _model(body: Mapping[str, Any], config: GatewayConfig, required: bool,
           adapters: Callable[[str], str | None] | None) -> tuple[ModelConfig, str | None]:
    """The served model and, when ``model`` names a LoRA adapter (configured, or listed by
    a worker: ``adapters(name)`` gives its base model), the adapter."""
    name = body.get("model")
    if name is None and not required:
        return config.models[0], None
    if not isinstance(name, str) or not name:
        raise _invalid("'model' is required and must be a string", "model")
    model = config.model(name)
    if model is not None:
        return model, None
    model = config.adapter_base(name)
    if model is None and adapters is not None:
        base = adapters(name)
        model = config.model(base) if base is not None else None
    if model is None:
        raise ClientError(f"model '{name}' is not served here", code=ErrorCode.MODEL_NOT_FOUND,
                          status=404, param="model")
    return model, name


def _lora(body: Mapping[str, Any], adapter: str | None) -> str | None:
    """The LoRA name the engine roots the request's blocks at: the adapter named as
    ``model``, else SGLang's ``lora_path`` / ``lora_name``."""
    named = _optional_str(body, "lora_path") or _optional_str(body, "lora_name")
    if adapter is not None and named is not None and named != adapter:
        raise _invalid(f"'model' names the adapter '{adapter}' and 'lora_path' another",
                       "lora_path")
    return adapter or named


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
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > model.max_messages:
        raise _invalid(f"'messages' holds {len(messages)} messages, over this model's limit "
                       f"of {model.max_messages}", "messages")
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


def parse_request(endpoint: InferencePath, body: dict[str, Any], config: GatewayConfig,
                  limits: Callable[[ModelConfig], Limits] | None = None,
                  adapters: Callable[[str], str | None] | None = None) -> InferenceRequest:
    """Validate a decoded body for ``endpoint``, and against the model's bounds
    (``limits(model)``; none by default); ``adapters(name)``: the base model of a LoRA
    adapter the workers list. Raises :class:`ClientError`."""
    model, adapter = _model(body, config, endpoint is not InferencePath.GENERATE, adapters)
    if endpoint is InferencePath.CHAT:
        prompt = _chat(body, model)
        _count(body, "max_completion_tokens", 0)
    elif endpoint is InferencePath.COMPLETIONS:
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
    params = body.get("sampling_params")
    if isinstance(params, dict):
        _count(params, "max_new_tokens", 0, "sampling_params.")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    wants_usage = bool(options and options.get("include_usage"))
    bounds = limits(model) if limits is not None else Limits()
    req = InferenceRequest(
        endpoint=endpoint,
        model=model,
        body=body,
        prompt=prompt,
        stream=stream,
        wants_usage=wants_usage,
        lora_name=_lora(body, adapter),
        cache_salt=_optional_str(body, "cache_salt"),
        limits=bounds,
        adapter=adapter,
    )
    tokens = len(prompt.token_ids) if prompt.kind is PromptKind.TOKENS else None
    precheck(model, bounds, body, tokens, req.prompt_param)
    return req
