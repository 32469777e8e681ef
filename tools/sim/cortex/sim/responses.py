"""The engines' response bodies and SSE chunks, built from :class:`SequenceResult` values (pure).

OpenAI shapes for ``/v1/chat/completions`` and ``/v1/completions`` (choices, usage with
``prompt_tokens_details.cached_tokens``, ``logprobs``), SGLang's native ``/generate`` shape
(``text``, ``output_ids``, ``meta_info`` with ``cached_tokens`` and the logprob lists).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cortex.sim import logprobs as lp
from cortex.sim.logprobs import FakeLogprobs, TokenLogprob
from cortex.sim.protocol import Endpoint, GenRequest, SequenceResult
from cortex.sim.textgen import FinishReason, GenerationPlan

__all__ = [
    "Shaping",
    "chat_chunk",
    "chat_response",
    "chat_token_logprobs",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "generate_chunk",
    "generate_response",
    "usage",
    "usage_chunk",
]


@dataclass(frozen=True, slots=True)
class Shaping:
    """What the builders need besides the results.

    ``finish_override``: SGLang prefill's native ``finish_reason``. ``prompt_logprobs``:
    False on an SGLang decode leg (no prompt was computed there: its input logprobs are
    empty and the router merges the prefill's in).
    """

    eos_token_id: int | None
    logprobs: FakeLogprobs
    finish_override: Mapping[str, Any] | None = None
    prompt_logprobs: bool = True

    def output(self, req: GenRequest, r: SequenceResult, done: int | None = None
               ) -> list[TokenLogprob]:
        """Logprobs of the first ``done`` (default all) generated tokens of ``r``."""
        want = req.logprobs
        if want is None:
            return []
        done = len(r.plan) if done is None else done
        return self.logprobs.output(r.prompt_tokens, r.plan.token_ids[:done],
                                    r.plan.pieces[:done], want.top)

    def prompt(self, req: GenRequest, r: SequenceResult) -> list[TokenLogprob]:
        """Logprobs of the prompt positions the request asked for."""
        want = req.logprobs
        if want is None or want.start is None or not self.prompt_logprobs:
            return []
        prompt = req.sequences[r.index].prompt_ids
        start = len(prompt) - 1 if want.start < 0 else want.start
        return self.logprobs.prompt(prompt, start, want.top)


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


def _chat_logprobs_body(req: GenRequest, entries: Sequence[TokenLogprob]
                        ) -> dict[str, Any] | None:
    return lp.openai_chat(entries) if req.logprobs is not None else None


def chat_response(req: GenRequest, results: Sequence[SequenceResult], shaping: Shaping,
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
                "logprobs": _chat_logprobs_body(req, shaping.output(req, r)),
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


def _echo_text(req: GenRequest, index: int) -> str:
    return (req.prompt_text[index] or "") if req.echo and index < len(req.prompt_text) else ""


def completion_logprobs(req: GenRequest, r: SequenceResult, shaping: Shaping, start: int,
                        stop: int, offset: int) -> dict[str, Any] | None:
    """Completions ``logprobs`` of output tokens ``start:stop`` (with the echoed prompt's
    when ``start`` is 0), text offsets from ``offset``."""
    want = req.logprobs
    if want is None:
        return None
    entries = shaping.prompt(req, r) if start == 0 else []
    entries += shaping.output(req, r, stop)[start:]
    return lp.openai_completion(entries, offset, want.top)


def completion_response(req: GenRequest, results: Sequence[SequenceResult], shaping: Shaping,
                        extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [
            {"index": r.index, "text": _echo_text(req, r.index) + r.plan.text,
             "logprobs": completion_logprobs(req, r, shaping, 0, len(r.plan), 0),
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
               shaping: Shaping) -> dict[str, Any]:
    finish: Mapping[str, Any] | None = None
    if finished:
        finish = shaping.finish_override or _finish_reason_native(r.plan, shaping.eos_token_id)
    meta: dict[str, Any] = {
        "id": req.request_id if not req.batched else f"{req.request_id}-{r.index}",
        "finish_reason": finish,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": done,
        "cached_tokens": r.cached_tokens,
        "e2e_latency": r.e2e_ms / 1000.0,
        "weight_version": "default",
    }
    want = req.logprobs
    if want is not None:
        prompt, output = shaping.prompt(req, r), shaping.output(req, r, done)
        meta["input_token_logprobs"] = lp.sglang_triples(prompt, want.text)
        meta["output_token_logprobs"] = lp.sglang_triples(output, want.text)
        if want.top:
            meta["input_top_logprobs"] = lp.sglang_top(prompt, want.text)
            meta["output_top_logprobs"] = lp.sglang_top(output, want.text)
    return meta


def generate_response(req: GenRequest, results: Sequence[SequenceResult], shaping: Shaping
                      ) -> Any:
    """SGLang ``/generate`` body: an object, or a list for batched input."""
    items = [
        {
            "text": r.plan.text,
            "output_ids": list(r.plan.token_ids),
            "meta_info": _meta_info(req, r, len(r.plan), True, shaping),
        }
        for r in results
    ]
    return items if req.batched else items[0]


def generate_chunk(req: GenRequest, r: SequenceResult, done: int, shaping: Shaping
                   ) -> dict[str, Any]:
    """One streamed ``/generate`` event: cumulative text and ids after ``done`` tokens."""
    finished = done == len(r.plan)
    chunk: dict[str, Any] = {
        "text": "".join(r.plan.pieces[:done]),
        "output_ids": list(r.plan.token_ids[:done]),
        "meta_info": _meta_info(req, r, done, finished, shaping),
    }
    if req.batched:
        chunk["index"] = r.index
    return chunk


def chat_chunk(req: GenRequest, index: int, delta: Mapping[str, Any],
               finish_reason: str | None = None, logprobs: Mapping[str, Any] | None = None
               ) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": "chat.completion.chunk",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": index, "delta": dict(delta),
                     "logprobs": None if logprobs is None else dict(logprobs),
                     "finish_reason": finish_reason}],
    }


def chat_token_logprobs(req: GenRequest, r: SequenceResult, shaping: Shaping, done: int
                        ) -> dict[str, Any] | None:
    """The streamed chat ``logprobs`` of token ``done`` (1-based) of ``r``."""
    if req.logprobs is None:
        return None
    return lp.openai_chat(shaping.output(req, r, done)[done - 1:])


def completion_chunk(req: GenRequest, index: int, text: str, finish_reason: str | None = None,
                     logprobs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": req.request_id,
        "object": "text_completion",
        "created": req.created,
        "model": req.model,
        "choices": [{"index": index, "text": text,
                     "logprobs": None if logprobs is None else dict(logprobs),
                     "finish_reason": finish_reason}],
    }


def usage_chunk(req: GenRequest, results: Sequence[SequenceResult]) -> dict[str, Any]:
    """The last chunk before ``[DONE]`` with ``include_usage``: no choices, only usage."""
    obj = "chat.completion.chunk" if req.endpoint is Endpoint.CHAT else "text_completion"
    return {"id": req.request_id, "object": obj, "created": req.created, "model": req.model,
            "choices": [], "usage": usage(results)}


def vllm_server_info(model: str, version: str) -> dict[str, Any]:
    """vLLM's dev-mode ``/server_info?config_format=json``: the fields peers read (its
    version decides which prefill and decode instances can pair)."""
    return {"vllm_config": {"model_config": {"model": model}}, "vllm_env": {},
            "system_env": {"vllm_version": version}}


def with_transfer_params(chunks: list[dict[str, Any]], result: SequenceResult, final: bool
                         ) -> list[dict[str, Any]]:
    """The stream ``chunks``, the last one carrying the sequence's ``kv_transfer_params``
    when this is the final chunk (vLLM >= 0.33, ``chat_completion/serving.py``)."""
    params = result.kv_transfer_params
    if not (final and params):
        return chunks
    return [*chunks[:-1], {**chunks[-1], "kv_transfer_params": dict(params)}]
