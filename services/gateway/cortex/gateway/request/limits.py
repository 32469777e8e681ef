"""A model's request bounds, and the checks that enforce them before any work (pure).

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

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cortex.gateway.config.gateway import ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode

__all__ = ["Limits", "check_prompt_tokens", "context_length_of", "model_limits",
           "prompt_chars", "requested_tokens"]

_TEXT_ROLES = frozenset({"system", "developer", "user", "tool"})
"""Roles whose content every chat template renders verbatim (assistant turns may be cut,
e.g. reasoning dropped): only these count toward the characters a prompt surely holds."""


@dataclass(frozen=True, slots=True)
class Limits:
    """A model's bounds in tokens (``None``: unbounded, or not known)."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    context_tokens: int | None = None


def context_length_of(lengths: Iterable[int | None]) -> int | None:
    """The smallest reported context length (tokens), ``None`` when none was reported."""
    known = [n for n in lengths if n is not None]
    return min(known) if known else None


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
