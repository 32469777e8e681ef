"""Request parsing and response shapes of the engines' HTTP APIs (pure, no I/O).

Parsing turns an OpenAI chat/completions body or an SGLang ``/generate`` body into a
:class:`GenRequest`: one :class:`SequenceSpec` per output sequence (batch prompts,
``n`` > 1), each with its prompt token ids and PD fields. Prompt tokens come from
:mod:`cortex.chat`, exactly as the engine computes them. Unknown fields are accepted
(routers add their own). Bad input raises :class:`RequestError` (a 4xx). What the engine
produces for each sequence is a :class:`SequenceResult` (shaped by :mod:`responses`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cortex.chat import ChatError, ChatTokenizer, render_args, text_add_special_tokens
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.media import media_items
from cortex.chat.messages_api import MessagesOptions, messages_chat_body, messages_options
from cortex.chat.responses_api import responses_chat_body
from cortex.chat.vision import VisionConfig, load_vision_config
from cortex.hashing import Engine, MediaSpan
from cortex.sim.logprobs import LogprobRequest
from cortex.sim.textgen import GenerationPlan

__all__ = [
    "Endpoint",
    "GenRequest",
    "RequestError",
    "SequenceResult",
    "SequenceSpec",
    "error_body",
    "lora_of",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "parse_messages",
    "parse_responses",
]

_MAX_ROOM = 2**63 - 1
_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI / vLLM / SGLang default for /v1/completions
_DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SGLang sampling_params default
_MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI allows 20 on chat


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"
    MESSAGES = "messages"  # Anthropic Messages
    RESPONSES = "responses"  # OpenAI Responses (stateless)


class RequestError(Exception):
    """A request the engine rejects; ``status`` is the HTTP status (4xx/5xx)."""

    def __init__(self, message: str, status: int = 400, err_type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type
        self.param = param


def error_body(engine: Engine, message: str, status: int, err_type: str = "BadRequestError",
               param: str | None = None) -> dict[str, Any]:
    """The engine's OpenAI-style error JSON (vLLM nests it under ``error``; SGLang does not)."""
    if engine is Engine.VLLM:
        return {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return {"object": "error", "message": message, "type": err_type, "param": param,
            "code": status}


@dataclass(frozen=True, slots=True)
class SequenceSpec:
    """One output sequence: prompt ids, its choice index and its SGLang PD fields."""

    index: int
    prompt_ids: tuple[int, ...]
    prompt_index: int = 0
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None


@dataclass(frozen=True, slots=True)
class GenRequest:
    """A parsed generation request (any endpoint)."""

    endpoint: Endpoint
    request_id: str
    model: str
    sequences: tuple[SequenceSpec, ...]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    echo: bool = False
    batched: bool = False
    """``/generate`` with a list input (answer is a list) or a completions prompt array."""
    kv_transfer_params: Mapping[str, Any] | None = None
    prompt_text: tuple[str | None, ...] = ()
    logprobs: LogprobRequest | None = None
    dp_rank: int | None = None
    """Data-parallel rank asked for (SGLang ``routed_dp_rank`` / ``data_parallel_rank``,
    vLLM ``X-data-parallel-rank``); ``None``: the engine picks."""
    prefill_dp_rank: int | None = None
    """SGLang decode: the prefill DP rank holding the KV (``disagg_prefill_dp_rank``)."""
    created: int = field(default_factory=lambda: int(time.time()))
    lora: str | None = None
    """The LoRA adapter serving the request (its blocks live in the adapter's namespace)."""
    media: tuple[MediaSpan, ...] = ()
    """vLLM: the prompt's media placeholder runs (their identifiers key its blocks)."""


@dataclass(frozen=True, slots=True)
class SequenceResult:
    """What one sequence produced (or is producing, when streamed)."""

    index: int
    prompt_tokens: int
    cached_tokens: int
    plan: GenerationPlan
    e2e_ms: float = 0.0
    prompt_index: int = 0
    kv_source: str | None = None
    """vLLM decode leg: ``"remote"`` (KV pulled from the prefill) or ``"local"`` (recomputed)."""
    kv_transfer_params: Mapping[str, Any] | None = None
    """vLLM prefill leg: the params that let a decode find the held blocks."""


# -- parsing ------------------------------------------------------------------------------


def _get_int(body: Mapping[str, Any], name: str, default: int | None, minimum: int
             ) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer", param=name)
    if value < minimum:
        raise RequestError(f"'{name}' must be at least {minimum}, got {value}", param=name)
    return value


def _get_bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be a boolean", param=name)
    return value


def _token_list(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in value
    ):
        raise RequestError(f"'{name}' must be a list of token ids", param=name)
    return tuple(value)


def _per_sequence(value: Any, count: int, name: str) -> list[Any]:
    """A PD field given once for all sequences or as a list with one entry each."""
    if isinstance(value, list):
        if len(value) != count:
            raise RequestError(f"'{name}' has {len(value)} entries for {count} sequences",
                               param=name)
        return value
    return [value] * count


def _pd_fields(body: Mapping[str, Any], count: int) -> list[tuple[str | None, int | None,
                                                                    int | None]]:
    hosts = _per_sequence(body.get("bootstrap_host"), count, "bootstrap_host")
    ports = _per_sequence(body.get("bootstrap_port"), count, "bootstrap_port")
    rooms = _per_sequence(body.get("bootstrap_room"), count, "bootstrap_room")
    out: list[tuple[str | None, int | None, int | None]] = []
    for host, port, room in zip(hosts, ports, rooms, strict=True):
        if host is not None and not isinstance(host, str):
            raise RequestError("'bootstrap_host' must be a string", param="bootstrap_host")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)):
            raise RequestError("'bootstrap_port' must be an integer", param="bootstrap_port")
        if room is not None and (isinstance(room, bool) or not isinstance(room, int)
                                 or not 0 <= room <= _MAX_ROOM):
            raise RequestError("'bootstrap_room' must be an integer in [0, 2**63-1]",
                               param="bootstrap_room")
        if host is not None and host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        out.append((host, port, room))
    return out


def _sequences(prompts: Sequence[tuple[int, ...]], n: int, body: Mapping[str, Any]
               ) -> tuple[SequenceSpec, ...]:
    flat = [(p, prompt) for p, prompt in enumerate(prompts) for _ in range(n)]
    pd = _pd_fields(body, len(flat))
    return tuple(
        SequenceSpec(index=i, prompt_ids=prompt, prompt_index=p, bootstrap_host=host,
                     bootstrap_port=port, bootstrap_room=room)
        for i, ((p, prompt), (host, port, room)) in enumerate(zip(flat, pd, strict=True))
    )


def _rank(body: Mapping[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RequestError(f"'{name}' must be a non-negative integer", param=name)
        return value
    return None


def _common(body: Mapping[str, Any]) -> dict[str, Any]:
    stream = _get_bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, Mapping):
            raise RequestError("'stream_options' must be an object", param="stream_options")
        include_usage = bool(options.get("include_usage", False))
    kv_params = body.get("kv_transfer_params")
    if kv_params is not None and not isinstance(kv_params, Mapping):
        raise RequestError("'kv_transfer_params' must be an object", param="kv_transfer_params")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise RequestError("'seed' must be an integer", param="seed")
    return {
        "stream": stream,
        "include_usage": include_usage and stream,
        "min_tokens": _get_int(body, "min_tokens", 0, 0) or 0,
        "ignore_eos": _get_bool(body, "ignore_eos"),
        "seed": seed,
        "kv_transfer_params": kv_params,
        # SGLang's DP routing fields (vLLM takes the rank from a header instead)
        "dp_rank": _rank(body, "routed_dp_rank", "data_parallel_rank"),
        "prefill_dp_rank": _rank(body, "disagg_prefill_dp_rank"),
    }


def _check_model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model", served)
    if model is None:
        return served
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    return model


def _top(body: Mapping[str, Any], name: str) -> int:
    top = _get_int(body, name, 0, 0) or 0
    if top > _MAX_TOP_LOGPROBS:
        raise RequestError(f"'{name}' must be at most {_MAX_TOP_LOGPROBS}", param=name)
    return top


def _chat_logprobs(body: Mapping[str, Any], engine: Engine) -> LogprobRequest | None:
    top = _top(body, "top_logprobs")
    if not _get_bool(body, "logprobs"):
        if top and engine is Engine.VLLM:
            raise RequestError("when using `top_logprobs`, `logprobs` must be set to true.",
                               param="top_logprobs")
        return None
    return LogprobRequest(top=top)


@functools.lru_cache(maxsize=8)
def _vision(source: str) -> VisionConfig | None:
    """The image settings of the model beside the served tokenizer (none: not a supported
    vision-language family, whose media the sim leaves as plain placeholder tokens)."""
    try:
        return load_vision_config(source)
    except ValueError:
        return None


def engine_media(body: Mapping[str, Any], ids: Sequence[int], vision: VisionConfig | None
                 ) -> tuple[list[int], tuple[MediaSpan, ...]]:
    """vLLM's multimodal prompt: each item's placeholder expanded to its run (one token
    where its size is unknown: a URL the sim does not fetch) and identified by its part's
    ``uuid``, else by a hash of the part (vLLM hashes the media itself)."""
    items = media_items(body, vision)
    if vision is None or not items:
        return list(ids), ()
    marks = [k for k, token in enumerate(ids) if token in vision.placeholder_ids]
    if len(marks) != len(items):
        return list(ids), ()
    out: list[int] = []
    spans: list[MediaSpan] = []
    at = 0
    for k, item in zip(marks, items, strict=True):
        out.extend(ids[at:k])
        part = body["messages"][item.message]["content"][item.part]
        identifier = item.identifier or "engine:" + hashlib.sha256(
            json.dumps(part, sort_keys=True).encode()).hexdigest()
        count = item.tokens or 1
        spans.append(MediaSpan(identifier, len(out), count))
        out.extend([ids[k]] * count)
        at = k + 1
    out.extend(ids[at:])
    return out, tuple(spans)


def parse_chat(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
               request_id: str | None = None, *, engine: Engine = Engine.SGLANG) -> GenRequest:
    """Parse ``/v1/chat/completions``: render the template over every message, tokenize."""
    try:
        prompt = tuple(tokenizer.encode_chat(render_args(body, engine)))
    except ChatError as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    media: tuple[MediaSpan, ...] = ()
    if engine is Engine.VLLM:
        expanded, media = engine_media(body, prompt, _vision(tokenizer.source))
        prompt = tuple(expanded)
    n = _get_int(body, "n", 1, 1) or 1
    max_tokens = _get_int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _get_int(body, "max_tokens", None, 1)
    return GenRequest(
        endpoint=Endpoint.CHAT,
        request_id=request_id or f"chatcmpl-{uuid.uuid4().hex}",
        model=_check_model(body, served_model),
        sequences=_sequences([prompt], n, body),
        max_tokens=max_tokens,
        logprobs=_chat_logprobs(body, engine),
        media=media,
        **_common(body),
    )


_PROBED: dict[tuple[int, Engine], MessagesOptions] = {}  # what the engine probes once


def _agent(endpoint: Endpoint, body: Mapping[str, Any], tokenizer: ChatTokenizer,
           served_model: str, request_id: str | None, engine: Engine, max_tokens: str
           ) -> GenRequest:
    """A Messages / Responses request: converted to the chat the engine renders."""
    try:
        key = (id(tokenizer.template), engine)
        options = _PROBED.get(key)
        if options is None:
            options = _PROBED[key] = messages_options(tokenizer, engine)
        if endpoint is Endpoint.MESSAGES:
            chat = messages_chat_body(body, engine, options)
        else:
            chat = responses_chat_body(body, engine, options)
        prompt = tuple(tokenizer.encode_chat(render_args(chat, engine)))
    except ChatError as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    except UnmodelledRequest as exc:
        raise RequestError(f"not modelled by the simulator: {exc}", param="messages") from exc
    prefix = "msg_" if endpoint is Endpoint.MESSAGES else "resp_"
    return GenRequest(
        endpoint=endpoint,
        request_id=request_id or f"{prefix}{uuid.uuid4().hex}",
        model=_check_model(body, served_model),
        sequences=_sequences([prompt], 1, body),
        max_tokens=_get_int(body, max_tokens, None, 1),
        **{**_common(body), "include_usage": False},
    )


def parse_messages(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
                   request_id: str | None = None, *, engine: Engine = Engine.SGLANG
                   ) -> GenRequest:
    """Parse ``/v1/messages``: the engine's conversion to a chat, rendered, tokenized."""
    return _agent(Endpoint.MESSAGES, body, tokenizer, served_model, request_id, engine,
                  "max_tokens")


def parse_responses(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
                    request_id: str | None = None, *, engine: Engine = Engine.SGLANG
                    ) -> GenRequest:
    """Parse a stateless ``/v1/responses`` request like :func:`parse_messages`."""
    return _agent(Endpoint.RESPONSES, body, tokenizer, served_model, request_id, engine,
                  "max_output_tokens")


def _prompt_list(value: Any, tokenizer: ChatTokenizer, name: str, add_special_tokens: bool
                 ) -> tuple[list[tuple[int, ...]], list[str | None], bool]:
    """Prompts of a completions/generate input: str | [str] | [int] | [[int]]."""
    if isinstance(value, str):
        return [tuple(tokenizer.encode_text(value, add_special_tokens))], [value], False
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return ([tuple(tokenizer.encode_text(p, add_special_tokens)) for p in value],
                    list(value), True)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in value):
            return [_token_list(value, name)], [None], False
        if all(isinstance(p, list) for p in value):
            prompts = [_token_list(p, name) for p in value]
            if any(not p for p in prompts):
                raise RequestError(f"'{name}' has an empty prompt", param=name)
            return prompts, [None] * len(prompts), True
    raise RequestError(f"'{name}' must be a string, a list of strings, a list of token ids "
                       "or a list of token id lists", param=name)


def parse_completion(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
                     request_id: str | None = None, *, engine: Engine = Engine.SGLANG
                     ) -> GenRequest:
    """Parse ``/v1/completions`` (text or token-id prompts, single or array)."""
    try:
        special = text_add_special_tokens(body, engine)
    except ChatError as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    prompts, texts, batched = _prompt_list(body.get("prompt"), tokenizer, "prompt", special)
    n = _get_int(body, "n", 1, 1) or 1
    echo = _get_bool(body, "echo")
    top = _get_int(body, "logprobs", None, 0)
    if top is not None and top > _MAX_TOP_LOGPROBS:
        raise RequestError(f"'logprobs' must be at most {_MAX_TOP_LOGPROBS}", param="logprobs")
    return GenRequest(
        endpoint=Endpoint.COMPLETIONS,
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        model=_check_model(body, served_model),
        sequences=_sequences(prompts, n, body),
        max_tokens=_get_int(body, "max_tokens", _DEFAULT_COMPLETION_MAX_TOKENS, 1),
        echo=echo,
        batched=batched,
        prompt_text=tuple(t for t in texts for _ in range(n)),
        logprobs=None if top is None else LogprobRequest(top=top, start=0 if echo else None),
        **_common(body),
    )


def _generate_logprobs(body: Mapping[str, Any], prompts: Sequence[tuple[int, ...]]
                       ) -> LogprobRequest | None:
    if not _get_bool(body, "return_logprob"):
        return None
    start = body.get("logprob_start_len", -1)
    if start is None:
        start = -1
    if isinstance(start, bool) or not isinstance(start, int) or start < -1:
        raise RequestError("'logprob_start_len' must be an integer >= -1",
                           param="logprob_start_len")
    for prompt in prompts:
        if start >= len(prompt):
            raise RequestError(f"req.logprob_start_len={start} is higher than the number of "
                               f"input tokens len(req.origin_input_ids)={len(prompt)}. Please "
                               "use a smaller logprob_start_len.", param="logprob_start_len")
    return LogprobRequest(top=_top(body, "top_logprobs_num"), start=start,
                          text=_get_bool(body, "return_text_in_logprobs"))


def parse_generate(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
                   request_id: str | None = None, *, engine: Engine = Engine.SGLANG
                   ) -> GenRequest:
    """Parse SGLang's native ``/generate`` (``text`` or ``input_ids``; lists = batch)."""
    if body.get("input_ids") is not None:
        prompts, texts, batched = _prompt_list(body["input_ids"], tokenizer, "input_ids", True)
        if any(t is not None for t in texts):
            raise RequestError("'input_ids' must hold token ids", param="input_ids")
    elif body.get("text") is not None:
        prompts, texts, batched = _prompt_list(body["text"], tokenizer, "text", True)
    else:
        raise RequestError("either 'text' or 'input_ids' is required", param="text")
    params = body.get("sampling_params") or {}
    if not isinstance(params, Mapping):
        raise RequestError("'sampling_params' must be an object", param="sampling_params")
    n = _get_int(params, "n", 1, 1) or 1
    rid = body.get("rid")
    common = _common(body)
    common["min_tokens"] = _get_int(params, "min_new_tokens", 0, 0) or 0
    common["ignore_eos"] = _get_bool(params, "ignore_eos")
    return GenRequest(
        endpoint=Endpoint.GENERATE,
        request_id=rid if isinstance(rid, str) and rid else (request_id or uuid.uuid4().hex),
        model=served_model,
        sequences=_sequences(prompts, n, body),
        max_tokens=_get_int(params, "max_new_tokens", _DEFAULT_GENERATE_MAX_NEW_TOKENS, 0),
        batched=batched or n > 1,
        prompt_text=tuple(t for t in texts for _ in range(n)),
        logprobs=_generate_logprobs(body, prompts),
        **common,
    )


def lora_of(req: GenRequest, body: Mapping[str, Any], engine: Engine, model: str,
            adapters: Sequence[str]) -> str | None:
    """The LoRA adapter a request asks for: vLLM names it as ``model``; SGLang takes
    ``lora_path`` (or ``model`` as ``base:adapter``). An adapter SGLang has not loaded is a
    400, as there."""
    if engine is Engine.VLLM:
        return req.model if req.model in adapters else None
    named = body.get("lora_path")
    if not isinstance(named, str) or not named:
        base, _, suffix = req.model.partition(":")
        named = suffix if base == model and suffix else None
    if named is None:
        return None
    if named not in adapters:
        raise RequestError(f"LoRA adapter '{named}' is not loaded", param="lora_path")
    return named
