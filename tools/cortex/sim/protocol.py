"""Request parsing and response shapes of the engines' HTTP APIs (pure, no I/O).

Parsing turns an OpenAI chat/completions body or an SGLang ``/generate`` body into a
:class:`GenRequest`: one :class:`SequenceSpec` per output sequence (batch prompts,
``n`` > 1), each with its prompt token ids and PD fields. Prompt tokens come from
:mod:`cortex.chat`, exactly as the engine computes them. Unknown fields are accepted
(routers add their own). Bad input raises :class:`RequestError` (a 4xx). The builders
turn :class:`SequenceResult` values into the engines' JSON bodies and SSE chunks.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from cortex.chat import ChatError, ChatTokenizer, render_args, text_add_special_tokens
from cortex.hashing import Engine
from cortex.sim import logprobs as lp
from cortex.sim.logprobs import FakeLogprobs, LogprobRequest, TokenLogprob
from cortex.sim.textgen import FinishReason, GenerationPlan

__all__ = [
    "Endpoint",
    "GenRequest",
    "RequestError",
    "SequenceResult",
    "SequenceSpec",
    "Shaping",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "error_body",
    "generate_chunk",
    "generate_response",
    "parse_chat",
    "parse_completion",
    "parse_generate",
    "usage",
    "usage_chunk",
]

_MAX_ROOM = 2**63 - 1
_DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI / vLLM / SGLang default for /v1/completions
_DEFAULT_GENERATE_MAX_NEW_TOKENS = 128  # SGLang sampling_params default
_MAX_TOP_LOGPROBS = 20  # vLLM's default --max-logprobs; OpenAI allows 20 on chat


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    GENERATE = "generate"


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
    }


def _check_model(body: Mapping[str, Any], served: str) -> str:
    model = body.get("model", served)
    if model is None:
        return served
    if not isinstance(model, str):
        raise RequestError("'model' must be a string", param="model")
    return model


def parse_chat(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
               request_id: str | None = None) -> GenRequest:
    """Parse ``/v1/chat/completions``: render the template over every message, tokenize."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", param="messages")
    kwargs: dict[str, Any] = {}
    template_kwargs = body.get("chat_template_kwargs")
    if isinstance(template_kwargs, Mapping):
        kwargs.update(template_kwargs)
    if body.get("tools"):
        kwargs["tools"] = body["tools"]
    add_generation_prompt = _get_bool(body, "add_generation_prompt", True)
    if _get_bool(body, "continue_final_message"):
        add_generation_prompt = False
    try:
        prompt = tuple(tokenizer.encode_chat(messages, add_generation_prompt, **kwargs))
    except TemplateError as exc:
        raise RequestError(str(exc), param="messages") from exc
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
        **_common(body),
    )


def _prompt_list(value: Any, tokenizer: ChatTokenizer, name: str
                 ) -> tuple[list[tuple[int, ...]], list[str | None], bool]:
    """Prompts of a completions/generate input: str | [str] | [int] | [[int]]."""
    if isinstance(value, str):
        return [tuple(tokenizer.encode_text(value))], [value], False
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return [tuple(tokenizer.encode_text(p)) for p in value], list(value), True
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
                     request_id: str | None = None) -> GenRequest:
    """Parse ``/v1/completions`` (text or token-id prompts, single or array)."""
    prompts, texts, batched = _prompt_list(body.get("prompt"), tokenizer, "prompt")
    n = _get_int(body, "n", 1, 1) or 1
    return GenRequest(
        endpoint=Endpoint.COMPLETIONS,
        request_id=request_id or f"cmpl-{uuid.uuid4().hex}",
        model=_check_model(body, served_model),
        sequences=_sequences(prompts, n, body),
        max_tokens=_get_int(body, "max_tokens", _DEFAULT_COMPLETION_MAX_TOKENS, 1),
        echo=_get_bool(body, "echo"),
        batched=batched,
        prompt_text=tuple(t for t in texts for _ in range(n)),
        **_common(body),
    )


def parse_generate(body: Mapping[str, Any], tokenizer: ChatTokenizer, served_model: str,
                   request_id: str | None = None) -> GenRequest:
    """Parse SGLang's native ``/generate`` (``text`` or ``input_ids``; lists = batch)."""
    if body.get("input_ids") is not None:
        prompts, texts, batched = _prompt_list(body["input_ids"], tokenizer, "input_ids")
        if any(t is not None for t in texts):
            raise RequestError("'input_ids' must hold token ids", param="input_ids")
    elif body.get("text") is not None:
        prompts, texts, batched = _prompt_list(body["text"], tokenizer, "text")
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
        **common,
    )


# -- responses ----------------------------------------------------------------------------


def usage(results: Sequence[SequenceResult]) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` always present.

    Prompt tokens are counted once per distinct prompt (``n`` copies share it).
    """
    prompts: dict[int, tuple[int, int]] = {}
    completion = 0
    for result in results:
        prompts.setdefault(result.prompt_index, (result.prompt_tokens, result.cached_tokens))
        completion += len(result.plan)
    prompt_tokens = sum(p for p, _ in prompts.values())
    cached = sum(c for _, c in prompts.values())
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def chat_response(req: GenRequest, results: Sequence[SequenceResult],
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": req.request_id,
        "object": "chat.completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.plan.text, "tool_calls": None,
                            "reasoning_content": None},
                "logprobs": None,
                "finish_reason": r.plan.finish_reason.value,
                "matched_stop": None,
            }
            for r in results
        ],
        "usage": usage(results),
    }
    if extra:
        body.update(extra)
    return body


def completion_response(req: GenRequest, results: Sequence[SequenceResult],
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    def text(r: SequenceResult) -> str:
        prefix = ""
        if req.echo and r.index < len(req.prompt_text):
            prefix = req.prompt_text[r.index] or ""
        return prefix + r.plan.text

    body: dict[str, Any] = {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {"index": r.index, "text": text(r), "logprobs": None,
             "finish_reason": r.plan.finish_reason.value}
            for r in results
        ],
        "usage": usage(results),
    }
    if extra:
        body.update(extra)
    return body


def _finish_reason_native(plan: GenerationPlan, eos_token_id: int | None
                          ) -> dict[str, Any]:
    if plan.finish_reason is FinishReason.STOP:
        return {"type": "stop", "matched": eos_token_id}
    return {"type": "length", "length": len(plan)}


def _meta_info(req: GenRequest, r: SequenceResult, done: int, finished: bool,
               eos_token_id: int | None, finish_override: Mapping[str, Any] | None
               ) -> dict[str, Any]:
    finish: Mapping[str, Any] | None = None
    if finished:
        finish = finish_override or _finish_reason_native(r.plan, eos_token_id)
    return {
        "id": req.request_id if not req.batched else f"{req.request_id}-{r.index}",
        "finish_reason": finish,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": done,
        "cached_tokens": r.cached_tokens,
        "e2e_latency": r.e2e_ms / 1000.0,
        "weight_version": "default",
    }


def generate_response(req: GenRequest, results: Sequence[SequenceResult],
                      eos_token_id: int | None,
                      finish_override: Mapping[str, Any] | None = None) -> Any:
    """SGLang ``/generate`` body: an object, or a list for batched input."""
    items = [
        {
            "text": r.plan.text,
            "output_ids": list(r.plan.token_ids),
            "meta_info": _meta_info(req, r, len(r.plan), True, eos_token_id, finish_override),
        }
        for r in results
    ]
    return items if req.batched else items[0]


def generate_chunk(req: GenRequest, r: SequenceResult, done: int, eos_token_id: int | None,
                   finish_override: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One streamed ``/generate`` event: cumulative text and ids after ``done`` tokens."""
    finished = done == len(r.plan)
    chunk: dict[str, Any] = {
        "text": "".join(r.plan.pieces[:done]),
        "output_ids": list(r.plan.token_ids[:done]),
        "meta_info": _meta_info(req, r, done, finished, eos_token_id, finish_override),
    }
    if req.batched:
        chunk["index"] = r.index
    return chunk


def chat_chunk(req: GenRequest, index: int, delta: Mapping[str, Any],
               finish_reason: str | None = None) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": index, "delta": dict(delta), "logprobs": None,
                     "finish_reason": finish_reason}],
    }


def completion_chunk(req: GenRequest, index: int, text: str, finish_reason: str | None = None
                     ) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": index, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}],
    }


def usage_chunk(req: GenRequest, results: Sequence[SequenceResult]) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` with ``include_usage``: no choices, only usage."""
    obj = "chat.completion.chunk" if req.endpoint is Endpoint.CHAT else "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [], "usage": usage(results)}
