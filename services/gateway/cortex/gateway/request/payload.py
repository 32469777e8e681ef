"""Request bodies → validated :class:`InferenceRequest` (pure; raises :class:`ClientError`).

Validation is deliberately shallow where the engine is the authority (sampling parameters
are forwarded untouched) and strict where the gateway acts on a field: the model, the prompt
it must tokenize exactly as the engine will, ``stream`` / ``stream_options`` it rewrites, and
the model's bounds (below: message count, prompt length, requested completion
tokens), checked before any tokenizing. Chat rendering arguments are the
engine's own reading of the body (:func:`cortex.chat.render_args` for the model's engine
kind), and so is whether a text prompt gets the tokenizer's special tokens.

A body must be UTF-8 JSON without lone surrogates (``"\\ud800"``: no tokenizer can encode
them) nested less deeply than Python's recursion limit; anything else is a 400.

A model's request bounds, and the checks that enforce them before any work (pure).
Bounds come from the model's config (``max_prompt_tokens``, ``max_tokens``, and
``max_model_len`` as the context length), else from what its engines report (the smallest
context length among the model's workers: a request must fit wherever it is routed):

* prompt tokens: ``max_prompt_tokens``, else context length - 1;
* completion tokens a request may ask for (``max_tokens``, ``max_completion_tokens``,
  SGLang ``sampling_params.max_new_tokens``): ``max_tokens``, else the context length;
* prompt + completion: the context length.

:func:`precheck` runs before tokenizing and costs microseconds: token-id prompts are
counted, text prompts are measured in characters against ``precheck_chars_per_token``
characters per token (a prompt whose text alone is longer cannot fit), and the requested
completion is range-checked. :func:`check_prompt_tokens` runs on the exact token count.
Over a bound: 400 ``context_length_exceeded`` (or ``invalid_request`` for an out-of-range
``max_tokens``), and nothing reaches a worker.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cortex.chat import ChatError, RenderArgs, render_args, text_add_special_tokens
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.media import MediaItem, Modality, media_items, stamp_identifiers
from cortex.chat.messages_api import MessagesOptions, messages_chat_body
from cortex.chat.responses_api import responses_chat_body
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.http.messages import JSONDecodeError, json_loads
from cortex.hashing import Engine

__all__ = ["AGENT_PATHS", "Admit", "InferencePath", "InferenceRequest", "Limits", "Prompt",
           "Unmodelled",
           "check_prompt_tokens", "model_limits", "parse_body", "parse_request", "prompt_chars",
           "requested_tokens"]


# ---- limits ----


_TEXT_ROLES = frozenset({"system", "developer", "user", "tool"})
"""Roles whose content every chat template renders verbatim (assistant turns may be cut,
e.g. reasoning dropped): only these count toward the characters a prompt surely holds."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A model's bounds in tokens (``None``: unbounded, or not known)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    context_tokens: int | None = None


def model_limits(model: ModelConfig, context_length: int | None) -> Limits:
    """``model``'s bounds given its engines' smallest ``context_length`` (tokens; the
    configured ``max_model_len`` wins)."""
    if model.max_model_len is not None:
        context_length = model.max_model_len
    prompt = model.max_prompt_tokens
    if prompt is None and context_length is not None:
        prompt = context_length - 1  # engines compute at least one output token
    completion = model.max_tokens if model.max_tokens is not None else context_length
    return Limits(prompt, completion, context_length)


def requested_tokens(body: Mapping[str, Any]) -> tuple[int | None, str]:
    """The completion tokens a request asks for and the field that says so."""
    for name in ("max_completion_tokens", "max_tokens"):
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value, name
    params = body.get("sampling_params")
    if isinstance(params, Mapping):
        value = params.get("max_new_tokens")
        if isinstance(value, int) and not isinstance(value, bool):
            return value, "sampling_params.max_new_tokens"
    return None, "max_tokens"


def _text_of(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(part["text"]) for part in content
                   if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return 0


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters the longest prompt of ``body`` surely renders to (a lower bound): the
    contents of non-assistant chat messages, or the longest text prompt of a batch."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return sum(_text_of(m.get("content")) for m in messages
                   if isinstance(m, Mapping) and m.get("role") in _TEXT_ROLES)
    for name in ("prompt", "text"):
        value = body.get(name)
        if isinstance(value, str):
            return len(value)
        if isinstance(value, list):
            return max((len(v) for v in value if isinstance(v, str)), default=0)
    return 0


def _too_long(message: str, param: str) -> ClientError:
    return ClientError(message, code=ErrorCode.CONTEXT_LENGTH_EXCEEDED, param=param)


def precheck(model: ModelConfig, limits: Limits, body: Mapping[str, Any],
             token_prompt: int | None, prompt_param: str) -> None:
    """Reject what cannot fit before tokenizing. ``token_prompt``: the length of a
    token-id prompt (``None`` for text)."""
    wanted, param = requested_tokens(body)
    cap = limits.completion_tokens
    if wanted is not None and cap is not None and wanted > cap:
        raise ClientError(f"'{param}' is {wanted}, over this model's limit of {cap} tokens",
                          code=ErrorCode.INVALID_REQUEST, param=param)
    limit = limits.prompt_tokens
    if limit is None:
        return
    if token_prompt is not None:
        check_prompt_tokens(limits, body, token_prompt, prompt_param)
        return
    chars = prompt_chars(body)
    if chars > limit * model.precheck_chars_per_token:
        raise _too_long(f"the prompt has {chars} characters, more than this model's limit of "
                        f"{limit} tokens can hold", prompt_param)


def check_prompt_tokens(limits: Limits, body: Mapping[str, Any], prompt_tokens: int,
                        prompt_param: str) -> None:
    """Reject a prompt of ``prompt_tokens`` tokens that does not fit, alone or with the
    completion the request asks for."""
    limit = limits.prompt_tokens
    if limit is not None and prompt_tokens > limit:
        raise _too_long(f"the prompt has {prompt_tokens} tokens, over this model's limit of "
                        f"{limit}", prompt_param)
    wanted, param = requested_tokens(body)
    context = limits.context_tokens
    if context is not None and wanted is not None and prompt_tokens + wanted > context:
        raise _too_long(f"this model's context length is {context} tokens; the request has "
                        f"{prompt_tokens} prompt tokens and asks for {wanted} more", param)


# ---- payload ----


_MAX_TOKEN_ID = 2**32 - 1
_MAX_COUNT = 2**31 - 1  # counts beyond int32 are no request any engine can serve
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


class InferencePath(StrEnum):
    """The inference endpoints (the upstream path is the same)."""

    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    GENERATE = "/generate"
    MESSAGES = "/v1/messages"  # Anthropic Messages: converted to a chat, as the engine does
    RESPONSES = "/v1/responses"  # stateless OpenAI Responses: likewise


AGENT_PATHS = (InferencePath.MESSAGES, InferencePath.RESPONSES)
"""The endpoints whose body the engine converts to a chat request before rendering it: the
gateway routes them on that chat, forwards the client's bytes untouched and relays the
engine's named SSE events as they come."""


class Unmodelled(Exception):
    """A valid Messages / Responses request whose conversion the gateway does not model
    (:class:`cortex.chat.errors.UnmodelledRequest`): relay it by load, as before."""


class PromptKind(StrEnum):
    CHAT = "chat"  # messages to render with the chat template
    TEXT = "text"  # plain text, tokenized with the tokenizer's special tokens
    TOKENS = "tokens"  # token ids given by the client


@dataclass(frozen=True, slots=True)
class Prompt:
    """The first prompt of the request (batches route on it): what to tokenize and how.

    ``chat``: the chat rendering arguments; ``add_special_tokens``: whether a text prompt
    gets the tokenizer's special tokens; ``media``: the chat's media items
    (:func:`cortex.chat.media.media_items`), or a ``/generate`` request's ``image_data`` /
    ``video_data`` / ``audio_data`` items (never keyed: :func:`generate_media`);
    ``stamped``: identifiers were written into the body as the parts' ``uuid`` (it is sent
    re-serialized)."""

    kind: PromptKind
    chat: RenderArgs | None = None
    text: str = ""
    add_special_tokens: bool = True
    token_ids: tuple[int, ...] = ()
    media: tuple[MediaItem, ...] = ()
    stamped: bool = False


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
        if self.endpoint in (InferencePath.CHAT, InferencePath.MESSAGES):
            return "messages"
        if self.endpoint is InferencePath.RESPONSES:
            return "input"
        if self.endpoint is InferencePath.COMPLETIONS:
            return "prompt"
        return "input_ids" if self.prompt.kind is PromptKind.TOKENS else "text"


def _bad_json(message: str) -> ClientError:
    return ClientError(message, code=ErrorCode.INVALID_JSON)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The JSON object of a request body (strict UTF-8, no lone surrogates)."""
    try:  # the C codec takes only what is valid; the rest is parsed again to say why not
        body = json_loads(raw)
    except JSONDecodeError:
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
    model = config.by_name.get(name)
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


def _chat(body: dict[str, Any], model: ModelConfig) -> Prompt:
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > model.max_messages:
        raise _invalid(f"'messages' holds {len(messages)} messages, over this model's limit "
                       f"of {model.max_messages}", "messages")
    try:
        args = render_args(body, model.engine)
    except ChatError as exc:
        raise _invalid(str(exc), exc.param) from None
    vllm = model.engine is Engine.VLLM  # SGLang's OpenAI routes take no identifier
    media = media_items(body, model.vision, model.immutable_urls, identify=vllm)
    stamped = vllm and any(item.stamp for item in media)
    if stamped:  # vLLM takes a part's uuid as the item's identifier in its block hashes
        stamp_identifiers(body, media)
    return Prompt(PromptKind.CHAT, chat=args, media=media, stamped=stamped)


_GENERATE_MEDIA = {"image_data": Modality.IMAGE, "video_data": Modality.VIDEO,
                   "audio_data": Modality.AUDIO}


def generate_media(body: Mapping[str, Any]) -> tuple[MediaItem, ...]:
    """A native ``/generate`` request's media items (SGLang: ``image_data`` etc., one item,
    a list of items, or a batch's lists — the first prompt's), none of them keyed: SGLang
    replaces each item's placeholder run by ids derived from its own hash of the item, so
    only the prompt before the first placeholder is keyed, as for chat media."""
    items: list[MediaItem] = []
    for name, modality in _GENERATE_MEDIA.items():
        value = body.get(name)
        if isinstance(value, list) and value and isinstance(value[0], list):
            value = value[0]  # a batch: the first prompt's items
        count = (len([v for v in value if v is not None]) if isinstance(value, list)
                 else int(value is not None))
        items.extend(MediaItem(-1, len(items), modality) for _ in range(count))
    return tuple(items)


def _special_tokens(body: Mapping[str, Any], model: ModelConfig) -> bool:
    try:
        return text_add_special_tokens(body, model.engine)
    except ChatError as exc:
        raise _invalid(str(exc), exc.param) from None


def _agent(endpoint: InferencePath, body: dict[str, Any], model: ModelConfig,
           options: MessagesOptions) -> dict[str, Any]:
    """The chat body the engine converts a Messages / Responses ``body`` to, with the
    completion bound under the chat name (``max_tokens``)."""
    try:
        if endpoint is InferencePath.MESSAGES:
            chat = messages_chat_body(body, model.engine, options)
            wanted = body.get("max_tokens")
        else:
            chat = responses_chat_body(body, model.engine, options)
            wanted = body.get("max_output_tokens")
            if wanted is not None and (isinstance(wanted, bool) or not isinstance(wanted, int)):
                raise _invalid("'max_output_tokens' must be an integer", "max_output_tokens")
    except ChatError as exc:
        raise _invalid(str(exc), exc.param) from None
    except UnmodelledRequest as exc:
        raise Unmodelled(str(exc)) from None
    if wanted is not None:
        chat["max_tokens"] = wanted
    return chat


class Admit:
    """``admit(endpoint, body)``: a decoded body validated for ``endpoint`` the one way every
    entry does (inference, ``/admin/explain``, the endpoint picker): against the config, the
    model's bounds and the adapters the workers list. Raises :class:`ClientError`.

    ``context_length(model)``: the smallest context length the model's engines reported;
    ``adapters(name)``: the base model of a LoRA adapter the workers list (the pool's)."""

    __slots__ = ("_adapters", "_context_length", "_messages_options", "config")

    def __init__(self, config: GatewayConfig, context_length: Callable[[str], int | None],
                 adapters: Callable[[str], str | None],
                 messages_options: Callable[[ModelConfig], MessagesOptions] | None = None
                 ) -> None:
        self.config = config
        self._context_length = context_length
        self._adapters = adapters
        self._messages_options = messages_options

    def __call__(self, endpoint: InferencePath, body: dict[str, Any]) -> InferenceRequest:
        return parse_request(endpoint, body, self.config, self.limits, self._adapters,
                             self._messages_options)

    def limits(self, model: ModelConfig) -> Limits:
        """``model``'s request bounds: its config, else what its workers' engines report."""
        return model_limits(model, self._context_length(model.name))


def parse_request(endpoint: InferencePath, body: dict[str, Any], config: GatewayConfig,
                  limits: Callable[[ModelConfig], Limits] | None = None,
                  adapters: Callable[[str], str | None] | None = None,
                  messages_options: Callable[[ModelConfig], MessagesOptions] | None = None
                  ) -> InferenceRequest:
    """Validate a decoded body for ``endpoint``, and against the model's bounds
    (``limits(model)``; none by default); ``adapters(name)``: the base model of a LoRA
    adapter the workers list; ``messages_options(model)``: what the model's engine probed
    from its template for ``/v1/messages``. Raises :class:`ClientError`, and
    :class:`Unmodelled` for a Messages / Responses request to relay by load.

    A Messages / Responses request is held as the chat body its engine converts it to
    (``body``; the client's bytes are what is forwarded), always streaming its usage."""
    model, adapter = _model(body, config, endpoint is not InferencePath.GENERATE, adapters)
    agent = endpoint in AGENT_PATHS
    if agent:
        stream = _bool(body, "stream")
        probed = messages_options(model) if messages_options is not None else MessagesOptions()
        salt = _optional_str(body, "cache_salt")
        body = _agent(endpoint, body, model, probed)
        if salt is not None:
            body["cache_salt"] = salt
        if stream:
            body["stream"] = True
    if endpoint is InferencePath.CHAT or agent:
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
    if endpoint is InferencePath.GENERATE and (media := generate_media(body)):
        prompt = dataclasses.replace(prompt, media=media)
    _count(body, "max_tokens", 0)
    _count(body, "n", 1)
    params = body.get("sampling_params")
    if isinstance(params, dict):
        _count(params, "max_new_tokens", 0, "sampling_params.")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _invalid("'stream_options' must be an object", "stream_options")
    wants_usage = agent or bool(options and options.get("include_usage"))
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
