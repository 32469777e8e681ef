"""The HTTP surface of SGLang / vLLM (per ``spec/engines-and-pd.md``) plus the admin API.

Thin: parse with :mod:`protocol`, serve with :class:`~cortex.sim.engine.SimEngine`, shape
with :mod:`protocol`. Admin paths under ``/sim/`` are never affected by HTTP faults:
``GET /sim/state``, ``GET /sim/cache``, ``GET|POST|DELETE /sim/faults``, ``POST /sim/restart``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from cortex.hashing import Engine
from cortex.sim import protocol as proto
from cortex.sim.config import Role, SimConfig
from cortex.sim.engine import SimEngine
from cortex.sim.faults import FaultState
from cortex.sim.metrics import LoadSnapshot, render_metrics
from cortex.sim.pd import TransferError
from cortex.sim.protocol import Endpoint, GenRequest, RequestError, SequenceResult

__all__ = ["SimRoutes"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[..., GenRequest]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "Connection": "keep-alive"}
_PREFILL_FINISH = {"type": "length", "length": 0}


class _StreamCut(Exception):
    """Fault: the stream was cut after k chunks."""


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SimRoutes:
    """Request handlers of one simulated worker; ``ports`` is filled in once bound."""

    def __init__(self, config: SimConfig, engine: SimEngine, faults: FaultState,
                 ports: Mapping[str, int | None], on_restart: Callable[[], None]) -> None:
        self.config = config
        self.engine = engine
        self.faults = faults
        self.ports = ports
        self._on_restart = on_restart
        self._faults_changed = asyncio.Event()
        self.shutting_down = False

    # -- wiring ---------------------------------------------------------------------------

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._fault_middleware], client_max_size=64 * 2**20)
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/v1/models", self._models)
        r.add_post("/v1/chat/completions", self._generation(proto.parse_chat))
        r.add_post("/v1/completions", self._generation(proto.parse_completion))
        r.add_get("/metrics", self._metrics)
        r.add_get("/version", self._version)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        if self.config.engine is Engine.SGLANG:
            for path in ("/server_info", "/get_server_info"):
                r.add_get(path, self._server_info)
            for path in ("/model_info", "/get_model_info"):
                r.add_get(path, self._model_info)
            r.add_get("/get_load", self._get_load)
            r.add_get("/v1/loads", self._loads)
            r.add_route("*", "/flush_cache", self._flush_cache)
            r.add_post("/generate", self._generation(proto.parse_generate))
        else:
            r.add_get("/load", self._load)
            r.add_get("/ping", self._health)
            r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        r.add_get("/sim/state", self._sim_state)
        r.add_get("/sim/cache", self._sim_cache)
        r.add_route("*", "/sim/faults", self._sim_faults)
        r.add_post("/sim/restart", self._sim_restart)
        return app

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Handler
                                ) -> web.StreamResponse:
        if request.path.startswith("/sim/"):
            return await handler(request)
        while self.faults.config.http_down:  # hang, like a wedged engine
            self._faults_changed.clear()
            await self._faults_changed.wait()
        if self.faults.config.latency_ms > 0:
            await asyncio.sleep(self.faults.config.latency_ms / 1000.0)
        status = self.faults.error_status()
        if status is not None:
            return self._error(f"injected fault: HTTP {status}", status, "InternalServerError")
        return await handler(request)

    def _error(self, message: str, status: int = 400, err_type: str = "BadRequestError",
               param: str | None = None) -> web.Response:
        return web.json_response(proto.error_body(self.config.engine, message, status, err_type,
                                                  param), status=status)

    # -- info and load --------------------------------------------------------------------

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(status=503 if self.shutting_down else 200)

    async def _version(self, _: web.Request) -> web.Response:
        return web.json_response({"version": self.config.engine_version})

    async def _models(self, _: web.Request) -> web.Response:
        cfg = self.config
        owner = "sglang" if cfg.engine is Engine.SGLANG else "vllm"
        return web.json_response({"object": "list", "data": [{
            "id": cfg.model, "object": "model", "created": int(self.engine.started_at),
            "owned_by": owner, "root": cfg.model, "parent": None,
            "max_model_len": cfg.max_model_len,
        }]})

    def _kv_events_info(self) -> dict[str, Any]:
        cfg = self.config
        info: dict[str, Any] = {
            "publisher": "zmq", "endpoint_host": cfg.public_host,
            "endpoint_port_base": self.ports.get("kv_events"), "topic": cfg.topic,
            "block_size": cfg.block_size, "dp_size": 1,
        }
        if self.ports.get("replay") is not None:
            info["replay_endpoint_port_base"] = self.ports["replay"]
        return info

    def server_info(self) -> dict[str, Any]:
        """SGLang ``/server_info``: server args + version + the routing-relevant fields."""
        cfg = self.config
        events_cfg: dict[str, Any] = {
            "publisher": "zmq", "endpoint": f"tcp://*:{self.ports.get('kv_events')}",
            "topic": cfg.topic, "buffer_steps": cfg.buffer_steps,
        }
        if self.ports.get("replay") is not None:
            events_cfg["replay_endpoint"] = f"tcp://*:{self.ports['replay']}"
        load = self.load()
        return {
            "model_path": cfg.model, "tokenizer_path": self.engine.chat.source,
            "served_model_name": cfg.model, "host": cfg.host, "port": self.ports.get("http"),
            "version": cfg.engine_version, "page_size": cfg.block_size,
            "context_length": cfg.max_model_len, "max_total_tokens":
                cfg.kv_capacity_blocks * cfg.block_size,
            "max_running_requests": cfg.max_running, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "disaggregation_mode": "null" if cfg.role is Role.REGULAR else cfg.role.value,
            "disaggregation_bootstrap_port": self.ports.get("bootstrap") or 8998,
            "disaggregation_transfer_backend": "mooncake",
            "disable_radix_cache": not self.engine.cache.enabled,
            "enable_cache_report": True, "skip_tokenizer_init": False,
            "chat_template": cfg.chat_template, "kv_events_config": json.dumps(events_cfg),
            "kv_events": self._kv_events_info(), "random_seed": cfg.seed,
            "status": "ready", "internal_states": [{
                "last_gen_throughput": 0.0, "#running-req": load.running,
                "#queue-req": load.waiting, "token_usage": load.kv_usage,
            }],
        }

    async def _server_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.config.model, "tokenizer_path": self.engine.chat.source,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
        })

    def load(self) -> LoadSnapshot:
        cache, engine = self.engine.cache, self.engine
        return LoadSnapshot(
            running=engine.running, waiting=engine.waiting, kv_usage=engine.kv_usage,
            used_tokens=cache.used_blocks * cache.block_size,
            total_tokens=cache.capacity * cache.block_size,
            prefix_query_tokens=cache.query_tokens, prefix_hit_tokens=cache.hit_tokens,
            prompt_tokens=engine.stats.prompt_tokens,
            generation_tokens=engine.stats.generation_tokens,
            finished_requests=engine.stats.requests_finished,
        )

    async def _get_load(self, _: web.Request) -> web.Response:
        load = self.load()
        return web.json_response([{
            "dp_rank": 0, "num_reqs": load.running + load.waiting,
            "num_waiting_reqs": load.waiting, "num_tokens": load.used_tokens,
            "num_pending_tokens": self.engine.admission.waiting_tokens,
            "ts_tic": time.perf_counter(),
        }])

    async def _loads(self, _: web.Request) -> web.Response:
        load = self.load()
        return web.json_response({"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
            "dp_rank": 0, "num_running_reqs": load.running, "num_waiting_reqs": load.waiting,
            "num_used_tokens": load.used_tokens, "num_total_tokens": load.total_tokens,
            "max_total_num_tokens": load.total_tokens, "token_usage": load.kv_usage,
            "cache_hit_rate": load.cache_hit_rate, "gen_throughput": 0.0,
            "num_waiting_tokens": self.engine.admission.waiting_tokens,
        }]})

    async def _load(self, _: web.Request) -> web.Response:
        return web.json_response({"server_load": self.engine.running + self.engine.waiting})

    async def _metrics(self, _: web.Request) -> web.Response:
        text = render_metrics(self.config.engine, self.config.version_tuple, self.config.model,
                              self.load())
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- cache control --------------------------------------------------------------------

    async def _flush_cache(self, _: web.Request) -> web.Response:
        if self.engine.flush_cache():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                "(When there are running or waiting requests, the operation "
                                "will not be performed.)\n")
        return web.Response(text="Cache flush failed: there are running or waiting requests.\n",
                            status=400)

    async def _reset_prefix_cache(self, _: web.Request) -> web.Response:
        if not self.engine.flush_cache():
            log.warning("Failed to reset prefix cache because some blocks are not freed yet")
        return web.Response(status=200)

    # -- tokenizer ------------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        chat = self.engine.chat
        try:
            if "messages" in body:
                tokens = chat.encode_chat(body["messages"],
                                          bool(body.get("add_generation_prompt", True)))
            elif isinstance(body.get("prompt"), str):
                tokens = chat.encode_text(body["prompt"])
            else:
                return self._error("'prompt' or 'messages' is required", param="prompt")
        except ValueError as exc:
            return self._error(str(exc))
        return web.json_response({"count": len(tokens), "max_model_len":
                                  self.config.max_model_len, "tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            return self._error("'tokens' must be a list of token ids", param="tokens")
        return web.json_response({"prompt": self.engine.chat.decode(tokens)})

    # -- generation -----------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return self._error("the request body is not valid JSON")
        if not isinstance(body, dict):
            return self._error("the request body must be a JSON object")
        return body

    def _generation(self, parse: Parser) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            body = await self._json(request)
            if isinstance(body, web.Response):
                return body
            request_id = request.headers.get("X-Request-Id")
            try:
                req = parse(body, self.engine.chat, self.config.model, None)
                if (self.config.engine is Engine.VLLM and req.endpoint is not Endpoint.GENERATE
                        and req.model != self.config.model):
                    return self._error(f"The model `{req.model}` does not exist.", 404,
                                       "NotFoundError", "model")
                self.engine.check(req)
            except RequestError as exc:
                return self._error(exc.message, exc.status, exc.err_type, exc.param)
            headers = {"X-Request-Id": request_id} if request_id else {}
            if req.stream:
                return await self._stream(request, req, headers)
            return await self._complete(req, headers)

        return handler

    async def _run_all(self, req: GenRequest,
                       emit: Callable[[SequenceResult, int], Awaitable[None]] | None
                       ) -> list[SequenceResult]:
        if len(req.sequences) == 1:
            return [await self.engine.run(req, req.sequences[0], emit)]
        tasks = [asyncio.ensure_future(self.engine.run(req, seq, emit)) for seq in req.sequences]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _body(self, req: GenRequest, results: Sequence[SequenceResult]) -> Any:
        extra: dict[str, Any] = {}
        params = results[0].kv_transfer_params if results else None
        if params is not None:
            extra["kv_transfer_params"] = dict(params)
        if req.endpoint is Endpoint.CHAT:
            return proto.chat_response(req, results, extra)
        if req.endpoint is Endpoint.COMPLETIONS:
            return proto.completion_response(req, results, extra)
        return proto.generate_response(req, results, self.engine.chat.eos_token_id,
                                       self._finish_override())

    def _finish_override(self) -> dict[str, Any] | None:
        if self.config.engine is Engine.SGLANG and self.config.role is Role.PREFILL:
            return _PREFILL_FINISH
        return None

    def _source_headers(self, results: Sequence[SequenceResult], headers: dict[str, str]
                        ) -> dict[str, str]:
        source = next((r.kv_source for r in results if r.kv_source), None)
        if source:
            headers = {**headers, "x-cortex-sim-kv-source": source}
        return headers

    async def _complete(self, req: GenRequest, headers: dict[str, str]) -> web.Response:
        try:
            results = await self._run_all(req, None)
        except TransferError as exc:
            log.warning("request %s aborted: %s", req.request_id, exc)
            return self._error(str(exc), 500, "InternalServerError")
        return web.json_response(self._body(req, results),
                                 headers=self._source_headers(results, headers))

    async def _stream(self, request: web.Request, req: GenRequest, headers: dict[str, str]
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await resp.prepare(request)
        lock = asyncio.Lock()
        cut_after = self.faults.config.cut_stream_after
        sent = 0
        eos = self.engine.chat.eos_token_id
        finish_override = self._finish_override()

        async def write(data: bytes) -> None:
            nonlocal sent
            if cut_after is not None and sent >= cut_after:
                raise _StreamCut
            await resp.write(data)
            sent += 1

        async def emit(result: SequenceResult, done: int) -> None:
            async with lock:
                for chunk in self._chunks(req, result, done, eos, finish_override):
                    await write(_sse(chunk))

        try:
            results = await self._run_all(req, emit)
            async with lock:
                if req.include_usage and req.endpoint is not Endpoint.GENERATE:
                    await write(_sse(proto.usage_chunk(req, results)))
                await write(b"data: [DONE]\n\n")
        except _StreamCut:
            log.info("fault: cut the stream of %s after %d chunks", req.request_id, sent)
            if request.transport is not None:
                request.transport.close()
            return resp
        except ConnectionResetError:
            log.info("client of %s went away mid-stream", req.request_id)
            return resp
        except TransferError as exc:
            log.warning("request %s aborted: %s", req.request_id, exc)
            body = proto.error_body(Engine.VLLM, str(exc), 500, "InternalServerError")
            async with lock:
                await resp.write(_sse(body))
                await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def _chunks(self, req: GenRequest, result: SequenceResult, done: int, eos: int | None,
                finish_override: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        plan = result.plan
        last = done == len(plan)
        piece = plan.pieces[done - 1]
        finish = plan.finish_reason.value if last else None
        if req.endpoint is Endpoint.GENERATE:
            return [proto.generate_chunk(req, result, done, eos, finish_override)]
        if req.endpoint is Endpoint.COMPLETIONS:
            text = piece
            if done == 1 and req.echo and result.index < len(req.prompt_text):
                text = (req.prompt_text[result.index] or "") + text
            return [proto.completion_chunk(req, result.index, text, finish)]
        chunks: list[dict[str, Any]] = []
        if done == 1:
            chunks.append(proto.chat_chunk(req, result.index, {"role": "assistant", "content": ""}))
        if piece or not last:
            chunks.append(proto.chat_chunk(req, result.index, {"content": piece}, finish))
        else:
            chunks.append(proto.chat_chunk(req, result.index, {}, finish))
        return chunks

    # -- admin ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        cache = self.engine.cache
        return {
            "engine": self.config.engine.value, "version": self.config.engine_version,
            "role": self.config.role.value, "model": self.config.model,
            "ports": dict(self.ports), "running": self.engine.running,
            "waiting": self.engine.waiting,
            "cache": {"capacity_blocks": cache.capacity, "block_size": cache.block_size,
                      "cached_blocks": cache.cached_blocks, "used_blocks": cache.used_blocks,
                      "pinned_blocks": cache.pinned_blocks, "evicted_blocks":
                          cache.evicted_blocks, "enabled": cache.enabled},
            "events": self.engine.event_state(),
            "stats": self.engine.stats_dict(),
            "faults": self.faults.snapshot(),
        }

    async def _sim_state(self, _: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def _sim_cache(self, request: web.Request) -> web.Response:
        with_tokens = request.query.get("tokens") in ("1", "true")
        blocks = []
        for block in self.engine.cache.blocks():
            item: dict[str, Any] = {"hash": block.event_id, "block_id": block.block_id,
                                    "parent": block.parent.event_id if block.parent else None,
                                    "refs": block.refs}
            if with_tokens:
                item["tokens"] = list(block.tokens)
            blocks.append(item)
        return web.json_response({"block_size": self.config.block_size, "blocks": blocks})

    async def _sim_faults(self, request: web.Request) -> web.Response:
        if request.method == "DELETE":
            self.faults.clear()
        elif request.method == "POST":
            body = await self._json(request)
            if isinstance(body, web.Response):
                return body
            try:
                self.faults.update(body)
            except (TypeError, ValueError) as exc:
                return self._error(str(exc))
        elif request.method != "GET":
            return self._error("use GET, POST or DELETE", 405, "MethodNotAllowed")
        self._faults_changed.set()
        return web.json_response(self.faults.snapshot())

    async def _sim_restart(self, _: web.Request) -> web.Response:
        self._on_restart()
        return web.json_response(self.state())

    def notify_faults_changed(self) -> None:
        self._faults_changed.set()
