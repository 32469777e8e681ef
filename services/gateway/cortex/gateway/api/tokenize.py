"""``POST /tokenize`` and ``POST /detokenize`` in the engines' shapes, and the alignment check.

The gateway answers with exactly the ids it routes on, in the shape of the model's engine
kind (:mod:`cortex.chat.tokenize_api`), so an operator can compare it with a worker::

    diff <(curl -s gateway/tokenize -d "$BODY") <(curl -s worker/tokenize -d "$BODY")

``max_model_len`` is the model's ``max_model_len`` setting (else the tokenizer's
``model_max_length``, else -1). The optional :class:`AlignmentCheck` does the same by
itself: every ``tokenize.self_check_interval_s`` it sends the latest routed prompt of each
model to one of its workers' ``/tokenize`` and counts matches and mismatches
(``cortex_gateway_tokenize_self_checks_total``; a mismatch is logged with both lengths and
the first differing position).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from cortex.chat import (
    ChatError,
    detokenize_query,
    detokenize_response,
    tokenize_query,
    tokenize_response,
)
from cortex.edge.tasks import stop_tasks
from cortex.gateway.config.gateway import GatewayConfig, ModelConfig
from cortex.gateway.errors import ClientError, ErrorCode
from cortex.gateway.http.asgi import Send
from cortex.gateway.http.messages import (
    Request,
    json_dumps,
    send_bytes,
)
from cortex.gateway.request.payload import parse_body
from cortex.gateway.runtime import Runtime
from cortex.gateway.tokens.service import Tokenization
from cortex.registry.spec import WorkerSpec

__all__ = ["AlignmentCheck", "TokenizeHandler", "first_difference"]

log = logging.getLogger(__name__)

_CHAT_FIELDS = ("messages", "tools", "tool_choice", "chat_template_kwargs", "reasoning_effort",
                "continue_final_message", "add_generation_prompt", "add_special_tokens")


def _model(body: Mapping[str, Any], config: GatewayConfig) -> ModelConfig:
    name = body.get("model")
    if name is None:
        return config.models[0]
    model = config.model(name) if isinstance(name, str) else None
    if model is None:
        raise ClientError(f"model '{name}' is not served here", code=ErrorCode.MODEL_NOT_FOUND,
                          status=404, param="model")
    return model



async def tokenize(tokenization: Tokenization, config: GatewayConfig,
                   body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``/tokenize`` answer for ``body``; raises :class:`ClientError`."""
    model = _model(body, config)
    try:
        query = tokenize_query(body, model.engine)
    except ChatError as exc:
        raise ClientError(str(exc), code=ErrorCode.INVALID_REQUEST, param=exc.param) from None
    if query.chat is not None:
        ids = [await tokenization.chat_tokens(model, query.chat)]
    else:
        ids = [await tokenization.text_tokens(model, text, query.add_special_tokens)
               for text in query.texts]
    chat = tokenization.tokenizers[model.name].chat
    max_len = model.max_model_len or chat.model_max_length or -1
    strs = [chat.token_strings(t) for t in ids] if query.token_strs else None
    return tokenize_response(query, ids, max_len, strs)


class TokenizeHandler:
    """The two endpoints of one gateway process."""

    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway
        router = gateway.router
        self.tokenization = router.tokenization

    async def _body(self, request: Request) -> dict[str, Any]:
        return parse_body(await request.body(self.gw.config.server.max_body_bytes))

    async def tokenize(self, request: Request, send: Send) -> None:
        answer = await tokenize(self.tokenization, self.gw.config, await self._body(request))
        await send_bytes(send, 200, json_dumps(answer), b"application/json")

    async def detokenize(self, request: Request, send: Send) -> None:
        body = await self._body(request)
        model = _model(body, self.gw.config)
        try:
            query = detokenize_query(body, model.engine)
        except ChatError as exc:
            raise ClientError(str(exc), code=ErrorCode.INVALID_REQUEST,
                              param=exc.param) from None
        chat = self.tokenization.tokenizers[model.name].chat
        texts = [chat.decode(ids, query.skip_special_tokens) for ids in query.tokens]
        await send_bytes(send, 200, json_dumps(detokenize_response(query, texts)),
                         b"application/json")


def first_difference(a: list[int], b: list[int]) -> int:
    """The first index where ``a`` and ``b`` differ (``min(len)`` if one extends the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def sample_body(req_body: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """The ``/tokenize`` body that re-tokenizes a routed request's (first) prompt."""
    if req_body.get("messages") is not None:
        body = {k: req_body[k] for k in _CHAT_FIELDS if k in req_body}
    elif isinstance(req_body.get("prompt"), str):
        body = {"prompt": req_body["prompt"]}
        if "add_special_tokens" in req_body:
            body["add_special_tokens"] = req_body["add_special_tokens"]
    else:
        return None
    return {"model": model, **body}


class AlignmentCheck:
    """Periodically compares the gateway's ids with a worker's ``/tokenize``; see the
    module. ``async with`` runs it (a no-op when the interval is 0)."""

    def __init__(self, gateway: Runtime) -> None:
        self.gw = gateway
        self.interval = gateway.config.tokenize.self_check_interval_s
        self._task: asyncio.Task[None] | None = None
        self._turn = itertools.count()

    async def __aenter__(self) -> AlignmentCheck:
        if self.interval > 0:
            self._task = asyncio.create_task(self._run(), name="gateway-tokenize-check")
        return self

    async def __aexit__(self, *exc: object) -> None:
        task, self._task = self._task, None
        if task is not None:
            await stop_tasks([task])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.check_once()

    async def check_once(self) -> dict[str, str]:
        """One round: per model with a routed prompt, ``{model: match|mismatch|error}``."""
        router = self.gw.router
        outcomes: dict[str, str] = {}
        for name, req_body in list(router.tokenization.recent.items()):
            model = self.gw.config.model(name)
            body = sample_body(req_body, name)
            workers = [w for w in self.gw.pool.candidates(name)
                       if model is not None and w.spec.engine is model.engine]
            if model is None or body is None or not workers:
                continue
            worker = workers[next(self._turn) % len(workers)]
            outcomes[name] = await self._compare(model, worker.spec, body)
        return outcomes

    async def _compare(self, model: ModelConfig, spec: WorkerSpec, body: dict[str, Any]
                       ) -> str:
        worker, url = spec.id, spec.url
        m = self.gw.metrics
        router = self.gw.router
        try:
            ours = (await tokenize(router.tokenization, self.gw.config, body))["tokens"]
            timeout = aiohttp.ClientTimeout(total=self.gw.config.tokenize.self_check_timeout_s)
            async with self.gw.upstream.session.post(url.rstrip("/") + "/tokenize", json=body,
                                                     timeout=timeout,
                                                     headers=self.gw.upstream.auth(spec)
                                                     ) as response:
                answer = await response.json(content_type=None)
            theirs = answer.get("tokens") if response.status == 200 and isinstance(
                answer, dict) else None
            if not isinstance(theirs, list):
                raise ValueError(f"status {response.status}")
        except (aiohttp.ClientError, TimeoutError, ValueError, ClientError) as exc:
            log.info("tokenize self-check failed model=%s worker=%s: %s", model.name, worker,
                     exc, extra={"worker": worker})
            m.tokenize_self_checks.labels(model=model.name, worker=worker,
                                          result="error").inc()
            return "error"
        result = "match" if ours == theirs else "mismatch"
        m.tokenize_self_checks.labels(model=model.name, worker=worker, result=result).inc()
        if result == "mismatch":
            log.warning("tokens differ from the worker's model=%s worker=%s gateway=%d "
                        "worker=%d first_difference=%d", model.name, worker, len(ours),
                        len(theirs), first_difference(ours, theirs), extra={"worker": worker})
        return result
