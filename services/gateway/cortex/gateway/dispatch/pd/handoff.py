"""The engines' prefill/decode handoff on the wire (pure): what each leg is sent, and how the
answers are put together for the client. ``shared/spec/engines-and-pd.md`` §3-§4.

SGLang (both legs at once, the same body): :func:`sglang_leg_body` adds
``bootstrap_host`` / ``bootstrap_port`` / ``bootstrap_room`` — lists with one entry per
sequence for batches and ``n > 1`` — and :func:`bootstrap_room` draws a fresh room whose
residue modulo the prefill's ``dp_size`` selects the DP rank that holds the prefix. With
``return_logprob`` the prefill's input logprobs are put in front of the decode's.

vLLM (one leg after the other): :func:`vllm_prefill_body` asks the prefill for one token and
``kv_transfer_params`` — in the answer, or (streamed, vLLM >= 0.33) in the stream's final
chunk (``entrypoints/openai/chat_completion/serving.py`` sets them on the chunk that carries
the finish reason), which :func:`vllm_prefill_result` reads either way;
:func:`vllm_decode_body` hands them on unchanged; the decode counts the pulled KV as cached,
so :func:`usage_from_prefill` takes the prompt side of the usage from the prefill's answer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from cortex.gateway.request.payload import InferencePath
from cortex.gateway.upstream.sse import EventRewrite
from cortex.registry.spec import WorkerSpec

__all__ = [
    "MAX_ROOM",
    "VLLM_PREFILL_PARAMS",
    "bootstrap_host",
    "bootstrap_room",
    "input_logprobs_rewrite",
    "merge_input_logprobs_body",
    "prefill_input_logprobs",
    "sequence_count",
    "sglang_leg_body",
    "usage_from_prefill",
    "usage_rewrite",
    "vllm_decode_body",
    "vllm_prefill_body",
    "wants_input_logprobs",
]

MAX_ROOM = 2**63 - 1
"""Largest SGLang ``bootstrap_room`` (rooms are integers in ``[0, 2**63-1]``)."""

VLLM_PREFILL_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""``kv_transfer_params`` of a vLLM prefill leg: compute, hold the blocks, say where."""

def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def bootstrap_room(rng: random.Random, dp_size: int = 1, dp_rank: int | None = None) -> int:
    """A fresh random room in ``[0, MAX_ROOM]``; with ``dp_rank`` its residue modulo
    ``dp_size`` is that rank (SGLang picks the prefill DP rank as ``room % dp_size``)."""
    room = rng.getrandbits(63)
    if dp_size > 1 and dp_rank is not None:
        room += dp_rank % dp_size - room % dp_size
        if room > MAX_ROOM:
            room -= dp_size
    return room


def bootstrap_host(spec: WorkerSpec) -> str:
    """The prefill's host as SGLang wants it: the URL's host, IPv6 in brackets."""
    host = spec.host
    return f"[{host}]" if ":" in host else host


def _positive_int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _prompt_count(value: Any) -> int:
    """Prompts in ``str | [str] | [int] | [[int]]`` (a list of ids is one prompt)."""
    if isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        return len(value)
    return 1


def sequence_count(endpoint: InferencePath, body: Mapping[str, Any]) -> int:
    """Output sequences the engine will run: prompts x ``n`` (each needs its own room)."""
    if endpoint is InferencePath.GENERATE:
        source = body.get("input_ids")
        if source is None:
            source = body.get("text")
        params = body.get("sampling_params")
        n = _positive_int(params.get("n", 1)) if isinstance(params, Mapping) else 1
        return _prompt_count(source) * n
    prompts = _prompt_count(body.get("prompt")) if endpoint is InferencePath.COMPLETIONS else 1
    return prompts * _positive_int(body.get("n", 1))


def _with_fields(raw: bytes, body: Mapping[str, Any], fields: Mapping[str, Any]) -> bytes:
    """``raw`` (the JSON object ``body``) with ``fields`` set: spliced in at the end when
    none is present (no re-serialization of a large prompt), else rebuilt."""
    end = raw.rstrip()
    if body and end.endswith(b"}") and not any(key in body for key in fields):
        return end[:-1] + b"," + _dumps(dict(fields))[1:]
    merged = dict(json.loads(raw)) if raw.strip() else {}
    merged.update(fields)
    return _dumps(merged)


def sglang_leg_body(raw: bytes, body: Mapping[str, Any], host: str, port: int | None,
                    rooms: Sequence[int]) -> bytes:
    """The body both SGLang legs get: the client's plus the bootstrap fields (scalars for
    one sequence, lists of ``len(rooms)`` otherwise). ``port`` ``None`` = engine default."""
    if len(rooms) == 1:
        fields: dict[str, Any] = {"bootstrap_host": host, "bootstrap_port": port,
                                  "bootstrap_room": rooms[0]}
    else:
        fields = {"bootstrap_host": [host] * len(rooms), "bootstrap_port": [port] * len(rooms),
                  "bootstrap_room": list(rooms)}
    return _with_fields(raw, body, fields)


def vllm_prefill_body(body: Mapping[str, Any], stream: bool = False) -> bytes:
    """The vLLM prefill leg: one token, holding its KV for a remote decode; ``stream``: as
    a stream whose final chunk carries the ``kv_transfer_params`` (and usage)."""
    out = dict(body)
    out["stream"] = stream
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)  # vLLM rejects it without streaming
    if stream:
        out["stream_options"] = {"include_usage": True}
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    return _dumps(out)


def vllm_prefill_result(data: bytes) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """A vLLM prefill answer's ``kv_transfer_params`` and ``usage`` (``None`` if absent),
    from a JSON body or an SSE stream (the last chunk that carries each)."""
    params: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    for obj in _answer_objects(data):
        found, counted = obj.get("kv_transfer_params"), obj.get("usage")
        if isinstance(found, dict):
            params = found
        if isinstance(counted, dict):
            usage = counted
    return params, usage


def _answer_objects(data: bytes) -> list[dict[str, Any]]:
    """The JSON objects of an answer: the body, or each ``data:`` event of a stream."""
    if not data.lstrip().startswith(b"data:"):
        try:
            obj = json.loads(data)
        except ValueError:
            return []
        return [obj] if isinstance(obj, dict) else []
    return [obj for obj in _stream_objects(data) if isinstance(obj, dict)]


def _stream_objects(data: bytes) -> list[Any]:
    """The decoded ``data:`` events of an SSE stream (``[DONE]`` and bad JSON skipped)."""
    out: list[Any] = []
    for event in data.replace(b"\r\n", b"\n").split(b"\n\n"):
        line = event.strip()
        if not line.startswith(b"data:") or line.endswith(b"[DONE]"):
            continue
        try:
            out.append(json.loads(line[5:]))
        except ValueError:
            continue
    return out


def vllm_decode_body(raw: bytes, body: Mapping[str, Any], params: Mapping[str, Any]) -> bytes:
    """The vLLM decode leg: the client's body plus the prefill's ``kv_transfer_params``,
    forwarded unchanged (newer engines add fields)."""
    return _with_fields(raw, body, {"kv_transfer_params": params})


def usage_from_prefill(decode: Mapping[str, Any], prefill: Mapping[str, Any]
                       ) -> dict[str, Any]:
    """vLLM PD usage: prompt tokens and their details from the prefill leg (the decode
    counts pulled KV as cached), completion tokens from the decode, total recomputed."""
    out = dict(decode)
    prompt = prefill.get("prompt_tokens")
    if isinstance(prompt, int):
        out["prompt_tokens"] = prompt
    details = prefill.get("prompt_tokens_details")
    if details is None:
        out.pop("prompt_tokens_details", None)
    else:
        out["prompt_tokens_details"] = details
    completion = out.get("completion_tokens")
    if isinstance(out.get("prompt_tokens"), int) and isinstance(completion, int):
        out["total_tokens"] = out["prompt_tokens"] + completion
    return out


def usage_rewrite(prefill_usage: Mapping[str, Any]) -> EventRewrite:
    """Rewrites every ``usage`` of the decode's answer with :func:`usage_from_prefill`."""

    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj = {**obj, "usage": usage_from_prefill(usage, prefill_usage)}
        return obj

    return EventRewrite(b'"usage"', apply)


# ---- SGLang input logprobs ----


def wants_input_logprobs(endpoint: InferencePath, body: Mapping[str, Any]) -> bool:
    """Whether the prefill's input logprobs must be merged (``/generate`` with
    ``return_logprob``: the prefill computed the prompt, the decode only its last token)."""
    return endpoint is InferencePath.GENERATE and body.get("return_logprob") is True


def _logprobs_of(obj: Any) -> list[Any] | None:
    meta = obj.get("meta_info") if isinstance(obj, dict) else None
    value = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    return value if isinstance(value, list) else None


def prefill_input_logprobs(data: bytes, stream: bool) -> dict[int, list[Any]]:
    """The prefill answer's ``meta_info.input_token_logprobs`` per sequence index (a stream:
    the first event of each index; a batch body: list position)."""
    out: dict[int, list[Any]] = {}
    if stream:
        for obj in _stream_objects(data):
            found = _logprobs_of(obj)
            index = obj.get("index", 0) if isinstance(obj, dict) else 0
            if found is not None and isinstance(index, int):
                out.setdefault(index, found)
        return out
    try:
        parsed = json.loads(data)
    except ValueError:
        return out
    items = parsed if isinstance(parsed, list) else [parsed]
    for i, item in enumerate(items):
        found = _logprobs_of(item)
        if found is not None:
            out[i] = found
    return out


def _merge(obj: dict[str, Any], prefill: Mapping[int, list[Any]], index: int) -> dict[str, Any]:
    decode = _logprobs_of(obj)
    ahead = prefill.get(index)
    if decode is None or ahead is None:
        return obj
    meta = {**obj["meta_info"], "input_token_logprobs": [*ahead, *decode]}
    return {**obj, "meta_info": meta}


def input_logprobs_rewrite(prefill: Mapping[int, list[Any]]) -> EventRewrite:
    """Streamed ``/generate`` events: the prefill's input logprobs put in front."""

    def apply(obj: dict[str, Any]) -> dict[str, Any]:
        index = obj.get("index", 0)
        return _merge(obj, prefill, index if isinstance(index, int) else 0)

    return EventRewrite(b'"input_token_logprobs"', apply)


def merge_input_logprobs_body(data: bytes, prefill: Mapping[int, list[Any]]) -> bytes:
    """A non-streamed ``/generate`` answer (object or batch list) with the prefill's input
    logprobs put in front; unchanged when it cannot be parsed."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return data
    if isinstance(parsed, list):
        return _dumps([_merge(item, prefill, i) if isinstance(item, dict) else item
                       for i, item in enumerate(parsed)])
    if isinstance(parsed, dict):
        return _dumps(_merge(parsed, prefill, 0))
    return data
