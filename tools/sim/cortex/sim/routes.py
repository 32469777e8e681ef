"""The HTTP surface of SGLang / vLLM (per ``spec/engines-and-pd.md``) plus the admin API.

Thin: parse with :mod:`protocol`, pick a data-parallel rank (:mod:`dp`), serve with that
rank's :class:`~cortex.sim.engine.SimEngine`, shape with :mod:`responses`. HTTP faults hit
the paths of their scope (generation endpoints by default); admin paths under ``/sim/``
never: ``GET /sim/state``, ``GET /sim/cache``, ``GET|POST|DELETE /sim/faults``,
``POST /sim/restart`` (their documents are built by :mod:`cortex.sim.admin`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

from cortex.chat import (
    ChatError,
    detokenize_query,
    detokenize_response,
    tokenize_query,
    tokenize_response,
)
from cortex.chat.errors import UnmodelledRequest
from cortex.chat.responses_api import responses_chat_body
from cortex.hashing import Engine
from cortex.sim import named_events as named
from cortex.sim import protocol as proto
from cortex.sim import responses as shape
from cortex.sim.admin import cache_listing, sim_state
from cortex.sim.auxiliary import AuxiliaryRoutes, auth_middleware
from cortex.sim.config import Role, SimConfig
from cortex.sim.discovery import add_vllm_discovery_routes, cache_config_info
from cortex.sim.dp import RankPicker
from cortex.sim.engine import SimEngine
from cortex.sim.faults import FaultState
from cortex.sim.logprobs import FakeLogprobs
from cortex.sim.media_fetch import inline_image_urls
from cortex.sim.metrics import LoadSnapshot, render_metrics, restrict
from cortex.sim.pd import TransferError
from cortex.sim.protocol import Endpoint, GenRequest, RequestError, SequenceResult, SequenceSpec

__all__ = ["SERVED_BY_HEADER", "SimRoutes"]

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Parser = Callable[..., GenRequest]

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "Connection": "keep-alive"}
_PREFILL_FINISH = {"type": "length", "length": 0}
_DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's explicit data-parallel rank
SERVED_BY_HEADER = "x-cortex-sim-port"
"""Response header of every generation: the HTTP port of the worker that served it."""
_STALL_CHECK_S = 0.2  # a stalled stream notices its client left within this (s)
_NAMED = (Endpoint.MESSAGES, Endpoint.RESPONSES)  # answered with named SSE events


class _StreamCut(Exception):
    """Fault: the stream was cut after k chunks."""


def _compact_json(obj: Any) -> str:
    """The engines' JSON bodies: compact, non-ASCII as is (FastAPI / orjson)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class SimRoutes:
    """Request handlers of one simulated worker (``engines``: one per DP rank); ``ports`` is
    filled in once bound."""

    def __init__(self, config: SimConfig, engines: Sequence[SimEngine], faults: FaultState,
                 ports: Mapping[str, int | None], on_restart: Callable[[], None]) -> None:
        self.config = config
        self.engines = list(engines)
        self.engine = self.engines[0]
        self.picker = RankPicker(config.engine, config.role, len(self.engines))
        chat = self.engine.chat
        finish = (_PREFILL_FINISH if config.engine is Engine.SGLANG
                  and config.role is Role.PREFILL else None)
        self.shaping = shape.Shaping(
            eos_token_id=chat.eos_token_id,
            logprobs=FakeLogprobs(self.engine.textgen.words, lambda t: chat.decode([t])),
            finish_override=finish,
            prompt_logprobs=not (config.engine is Engine.SGLANG and config.role is Role.DECODE))
        self.faults = faults
        self.ports = ports
        self._on_restart = on_restart
        self._faults_changed = asyncio.Event()
        self.shutting_down = False
        self.seen: dict[str, str] = {}  # the last request's trace context (``traceparent``)
        self.auxiliary = AuxiliaryRoutes(config.model, lambda: {
            SERVED_BY_HEADER: str(self.ports.get("http"))})
        self._generate_responses = self._generation(proto.parse_responses)

    # -- wiring ---------------------------------------------------------------------------

    def build(self) -> web.Application:
        app = web.Application(middlewares=[auth_middleware(self.config.api_key, self.seen),
                                                       self._fault_middleware],
                              client_max_size=64 * 2**20)
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/health_generate", self._health)
        r.add_get("/v1/models", self._models)
        r.add_post("/v1/chat/completions", self._generation(proto.parse_chat))
        r.add_post("/v1/completions", self._generation(proto.parse_completion))
        r.add_post("/v1/messages", self._generation(proto.parse_messages))
        r.add_post("/v1/responses", self._responses)
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
            r.add_get("/metrics/", self._metrics)  # prometheus_client's app: ?name[]= filters
            r.add_get("/ping", self._health)
            r.add_get("/server_info", self._vllm_server_info)
            r.add_post("/reset_prefix_cache", self._reset_prefix_cache)
            add_vllm_discovery_routes(r, self.config, self.ports)
        self.auxiliary.add_to(app)
        r.add_get("/sim/state", self._sim_state)
        r.add_get("/sim/cache", self._sim_cache)
        r.add_route("*", "/sim/faults", self._sim_faults)
        r.add_post("/sim/restart", self._sim_restart)
        return app

    @web.middleware
    async def _fault_middleware(self, request: web.Request, handler: Handler
                                ) -> web.StreamResponse:
        if request.path.startswith("/sim/") or not self._in_scope(request.path):
            return await handler(request)
        while self.faults.config.http_down and self._in_scope(request.path):  # wedged engine
            self._faults_changed.clear()
            await self._faults_changed.wait()
        if not self._in_scope(request.path):
            return await handler(request)
        if self.faults.config.latency_ms > 0:
            await asyncio.sleep(self.faults.config.latency_ms / 1000.0)
        status = self.faults.error_status()
        if status is not None:
            return self._error(f"injected fault: HTTP {status}", status, "InternalServerError")
        return await handler(request)

    def _in_scope(self, path: str) -> bool:
        """Whether the HTTP faults hit ``path`` now (admin paths never reach here)."""
        return self.faults.config.fault_paths.covers(path)

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
        created = int(self.engine.started_at)
        adapters = [{"id": name, "object": "model", "created": created, "owned_by": owner,
                     "root": f"/adapters/{name}", "parent": cfg.model, "max_model_len": None}
                    for name in cfg.lora_adapters]
        return web.json_response({"object": "list", "data": [{
            "id": cfg.model, "object": "model", "created": created,
            "owned_by": owner, "root": cfg.model, "parent": None,
            "max_model_len": cfg.max_model_len,
        }, *adapters]})

    def _kv_events_info(self) -> dict[str, Any]:
        cfg = self.config
        info: dict[str, Any] = {
            "publisher": "zmq", "endpoint_host": cfg.public_host,
            "endpoint_port_base": self.ports.get("kv_events"), "topic": cfg.topic,
            "block_size": cfg.block_size, "dp_size": cfg.dp_size,
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
        states = [{
            "last_gen_throughput": 0.0, "#running-req": rank.running,
            "#queue-req": rank.waiting, "token_usage": rank.kv_usage,
        } for rank in self.loads()]
        return {
            "model_path": cfg.model, "tokenizer_path": self.engine.chat.source,
            "served_model_name": cfg.model, "host": cfg.host, "port": self.ports.get("http"),
            "version": cfg.engine_version, "page_size": cfg.block_size,
            "context_length": cfg.max_model_len, "max_total_num_tokens":
                cfg.kv_capacity_blocks * cfg.block_size,
            "max_running_requests": cfg.max_running, "tp_size": 1, "dp_size": cfg.dp_size,
            "pp_size": 1,
            "disaggregation_mode": "null" if cfg.role is Role.REGULAR else cfg.role.value,
            "disaggregation_bootstrap_port": self.ports.get("bootstrap") or 8998,
            "disaggregation_transfer_backend": "mooncake",
            "disable_radix_cache": not self.engine.cache.enabled,
            "enable_cache_report": True, "skip_tokenizer_init": False,
            "chat_template": cfg.chat_template, "kv_events_config": json.dumps(events_cfg),
            "kv_events": self._kv_events_info(), "random_seed": cfg.seed,
            "speculative_algorithm": "EAGLE" if cfg.eagle_lookahead else None,
            "status": "ready", "internal_states": states,
        }

    async def _server_info(self, _: web.Request) -> web.Response:
        return web.json_response(self.server_info())

    @property
    def _final_params(self) -> bool:
        """vLLM >= 0.33 sets a stream's ``kv_transfer_params`` on its final chunk."""
        return self.config.engine is Engine.VLLM and self.config.version_tuple >= (0, 33)

    async def _vllm_server_info(self, _: web.Request) -> web.Response:
        """vLLM's dev-mode ``/server_info`` (``config_format=json``), the fields peers read."""
        return web.json_response(shape.vllm_server_info(self.config.model,
                                                        self.config.engine_version))

    async def _model_info(self, _: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.config.model, "tokenizer_path": self.engine.chat.source,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
        })

    @staticmethod
    def _load_of(engine: SimEngine) -> LoadSnapshot:
        cache = engine.cache
        now = time.monotonic()
        return LoadSnapshot(
            running=engine.running, waiting=engine.waiting, kv_usage=engine.kv_usage,
            used_tokens=max(0, cache.used_blocks * cache.block_size
                            - engine.undecoded_tokens(now)),
            total_tokens=cache.capacity * cache.block_size,
            prefix_query_tokens=cache.query_tokens, prefix_hit_tokens=cache.hit_tokens,
            prompt_tokens=engine.stats.prompt_tokens,
            generation_tokens=engine.generated_tokens(now),
            finished_requests=engine.stats.requests_finished,
        )

    def loads(self) -> list[LoadSnapshot]:
        """One load snapshot per data-parallel rank."""
        return [self._load_of(engine) for engine in self.engines]

    def load(self) -> LoadSnapshot:
        """The whole worker's load (the sum over its ranks)."""
        return LoadSnapshot.total(self.loads())

    async def _get_load(self, _: web.Request) -> web.Response:
        return web.json_response([{
            "dp_rank": rank, "num_reqs": load.running + load.waiting,
            "num_waiting_reqs": load.waiting, "num_tokens": load.used_tokens,
            "num_pending_tokens": engine.admission.waiting_tokens,
            "ts_tic": time.perf_counter(),
        } for rank, (engine, load) in enumerate(zip(self.engines, self.loads(), strict=True))])

    async def _loads(self, _: web.Request) -> web.Response:
        return web.json_response({
            "timestamp": time.time(), "dp_rank_count": len(self.engines), "loads": [{
                "dp_rank": rank, "num_running_reqs": load.running,
                "num_waiting_reqs": load.waiting, "num_used_tokens": load.used_tokens,
                "num_total_tokens": load.total_tokens, "max_total_num_tokens": load.total_tokens,
                "token_usage": load.kv_usage, "cache_hit_rate": load.cache_hit_rate,
                "gen_throughput": 0.0, "num_waiting_tokens": engine.admission.waiting_tokens,
            } for rank, (engine, load) in enumerate(zip(self.engines, self.loads(),
                                                        strict=True))]})

    async def _load(self, _: web.Request) -> web.Response:
        load = self.load()
        return web.json_response({"server_load": load.running + load.waiting})

    async def _metrics(self, request: web.Request) -> web.Response:
        """``/metrics``; vLLM's ``/metrics/`` mount also takes ``?name[]=`` (its exact
        ``/metrics`` route ignores it, as vLLM's does)."""
        text = render_metrics(self.config.engine, self.config.version_tuple, self.config.model,
                              self.loads())
        if self.config.engine is Engine.VLLM:
            text += cache_config_info(self.config)
        names = request.query.getall("name[]", [])
        if request.path == "/metrics/" and names:
            text = restrict(text, names)
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    # -- cache control --------------------------------------------------------------------

    def _flush_all(self) -> bool:
        """Flush every rank's cache (each refuses while it holds requests)."""
        return all([engine.flush_cache() for engine in self.engines])

    async def _flush_cache(self, _: web.Request) -> web.Response:
        if self._flush_all():
            return web.Response(text="Cache flushed.\nPlease check backend logs for more details. "
                                "(When there are running or waiting requests, the operation "
                                "will not be performed.)\n")
        return web.Response(text="Cache flush failed: there are running or waiting requests.\n",
                            status=400)

    async def _reset_prefix_cache(self, _: web.Request) -> web.Response:
        if not self._flush_all():
            log.warning("Failed to reset prefix cache because some blocks are not freed yet")
        return web.Response(status=200)

    # -- tokenizer ------------------------------------------------------------------------

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        chat = self.engine.chat
        try:
            query = tokenize_query(body, self.config.engine)
            if query.chat is not None:
                ids = [chat.encode_chat(query.chat)]
            else:
                ids = [chat.encode_text(text, query.add_special_tokens) for text in query.texts]
        except ChatError as exc:
            return self._error(str(exc), param=exc.param)
        max_len = self.config.max_model_len
        if self.config.engine is Engine.SGLANG:  # SGLang reports the tokenizer's length
            max_len = chat.model_max_length or max_len
        strs = [chat.token_strings(t) for t in ids] if query.token_strs else None
        return web.json_response(tokenize_response(query, ids, max_len, strs),
                                 dumps=_compact_json)

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if isinstance(body, web.Response):
            return body
        try:
            query = detokenize_query(body, self.config.engine)
        except ChatError as exc:
            return self._error(str(exc), param=exc.param)
        texts = [self.engine.chat.decode(ids, query.skip_special_tokens) for ids in query.tokens]
        return web.json_response(detokenize_response(query, texts), dumps=_compact_json)

    # -- generation -----------------------------------------------------------------------

    async def _json(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            if self.config.engine is Engine.VLLM:  # FastAPI's validation error, as vLLM 0.32's
                return self._error("1 validation error: JSON decode error",
                                   err_type="Bad Request", param="body.0")
            return self._error("the request body is not valid JSON")
        if not isinstance(body, dict):
            return self._error("the request body must be a JSON object")
        return body

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """A stateless ``/v1/responses`` request is a generation; a follow-up by
        ``previous_response_id``, or a request whose conversion ``cortex.chat`` does not
        model (every SGLang one), gets the kept-responses stand-in answer."""
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if isinstance(body, dict):
            try:
                responses_chat_body(body, self.config.engine)
            except UnmodelledRequest:
                return await self.auxiliary.reply(request)
            except ChatError:
                pass  # the generation path answers it
        return await self._generate_responses(request)

    def _generation(self, parse: Parser) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            arrived = time.monotonic()
            body = await self._json(request)
            if isinstance(body, web.Response):
                return body
            request_id = request.headers.get("X-Request-Id")
            try:
                if parse is proto.parse_chat and self.config.engine is Engine.VLLM:
                    body = await inline_image_urls(body)  # vLLM fetches URL images itself
                req = parse(body, self.engine.chat, self.config.model, None,
                            engine=self.config.engine)
                lora = proto.lora_of(req, body, self.config.engine, self.config.model,
                                     self.config.lora_adapters)
                if lora is not None:
                    req = dataclasses.replace(req, lora=lora)
                elif (self.config.engine is Engine.VLLM and req.endpoint is not Endpoint.GENERATE
                        and req.model != self.config.model):
                    return self._error(f"The model `{req.model}` does not exist.", 404,
                                       "NotFoundError", "model")
                req = self._with_header_rank(req, request)
                wrong_rank = self.picker.check(req.dp_rank)
                if wrong_rank:
                    raise RequestError(wrong_rank, param="data_parallel_rank")
                self.engine.check(req)
            except RequestError as exc:
                return self._error(exc.message, exc.status, exc.err_type, exc.param)
            headers = {"X-Request-Id": request_id} if request_id else {}
            # which worker answered, through any router that relays upstream headers
            headers[SERVED_BY_HEADER] = str(self.ports.get("http"))
            if req.stream:
                return await self._stream(request, req, headers, arrived)
            return await self._complete(req, headers)

        return handler

    def _with_header_rank(self, req: GenRequest, request: web.Request) -> GenRequest:
        """vLLM takes an explicit data-parallel rank from a header."""
        header = request.headers.get(_DP_RANK_HEADER)
        if self.config.engine is not Engine.VLLM or header is None:
            return req
        try:
            rank = int(header)
        except ValueError:
            raise RequestError(f"{_DP_RANK_HEADER} must be an integer, got {header!r}",
                               param="data_parallel_rank") from None
        return dataclasses.replace(req, dp_rank=rank)

    async def _run_one(self, req: GenRequest, seq: SequenceSpec,
                       emit: Callable[[SequenceResult, int], Awaitable[None]] | None
                       ) -> SequenceResult:
        # Picked when the sequence starts, so earlier sequences already count as load.
        rank = self.picker.pick(req.dp_rank, seq.bootstrap_room,
                                [(e.waiting, e.running) for e in self.engines])
        return await self.engines[rank].run(req, seq, emit)

    async def _run_all(self, req: GenRequest,
                       emit: Callable[[SequenceResult, int], Awaitable[None]] | None
                       ) -> list[SequenceResult]:
        if len(req.sequences) == 1:
            return [await self._run_one(req, req.sequences[0], emit)]
        tasks = [asyncio.ensure_future(self._run_one(req, seq, emit)) for seq in req.sequences]
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
        if req.endpoint in _NAMED:
            return named.named_response(req, results[0], self.config.engine)
        if req.endpoint is Endpoint.CHAT:
            return shape.chat_response(req, results, self.shaping, extra)
        if req.endpoint is Endpoint.COMPLETIONS:
            return shape.completion_response(req, results, self.shaping, extra)
        return shape.generate_response(req, results, self.shaping)

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
        body = self._body(req, results)
        if req.endpoint is Endpoint.RESPONSES:
            self.auxiliary.keep(body)
        return web.json_response(body, headers=self._source_headers(results, headers))

    async def _stream(self, request: web.Request, req: GenRequest, headers: dict[str, str],
                      arrived: float | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**_SSE_HEADERS, **headers})
        await resp.prepare(request)
        lock = asyncio.Lock()
        cut_after = self.faults.config.cut_stream_after
        sent = 0

        async def write(data: bytes) -> None:
            nonlocal sent
            if cut_after is not None and sent >= cut_after:
                raise _StreamCut
            await self._stall(request, sent)
            await resp.write(data)
            sent += 1

        numbered = 0  # Responses events carry a sequence number
        opened = False

        async def write_named(events: list[dict[str, Any]]) -> None:
            nonlocal numbered
            if req.endpoint is Endpoint.RESPONSES:
                events = named.numbered(events, numbered)
                numbered += len(events)
            for event in events:
                await write(named.event_bytes(event))

        stats = self.engine.stats

        async def emit(result: SequenceResult, done: int) -> None:
            nonlocal opened, arrived
            if arrived is not None:  # the first token: the engine's share of the TTFT
                stats.first_token_streams += 1
                stats.first_token_us += int((time.monotonic() - arrived) * 1e6)
                arrived = None
            async with lock:
                if req.endpoint in _NAMED:
                    events = [] if opened else named.opening_events(req, result, engine)
                    opened = True
                    await write_named([*events, *named.piece_events(
                        req, result.plan.pieces[done - 1])])
                    return
                for chunk in self._chunks(req, result, done):
                    await write(_sse(chunk))

        engine = self.config.engine
        try:
            await self._stall(request, 0)
            results = await self._run_all(req, emit)
            async with lock:
                if req.endpoint in _NAMED:
                    last = results[0]
                    closing = named.closing_events(req, last, engine)
                    if req.endpoint is Endpoint.RESPONSES:
                        self.auxiliary.keep(closing[-1]["response"])
                    await write_named([*([] if opened else named.opening_events(
                        req, last, engine)), *closing])
                else:
                    if req.include_usage and req.endpoint is not Endpoint.GENERATE:
                        await write(_sse(shape.usage_chunk(req, results)))
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

    async def _stall(self, request: web.Request, sent: int) -> None:
        """Fault: hold a stream that sent ``sent`` chunks, silent, while the fault says so
        and the client stays."""
        while True:
            stall = self.faults.config.stall_stream_after
            transport = request.transport
            if (stall is None or sent < stall or transport is None
                    or transport.is_closing()):
                return
            self._faults_changed.clear()
            with contextlib.suppress(TimeoutError):  # look at the connection now and then
                async with asyncio.timeout(_STALL_CHECK_S):
                    await self._faults_changed.wait()

    def _chunks(self, req: GenRequest, result: SequenceResult, done: int
                ) -> list[dict[str, Any]]:
        plan = result.plan
        last = done == len(plan)
        piece = plan.pieces[done - 1]
        finish = plan.finish_reason.value if last else None
        if req.endpoint is Endpoint.GENERATE:
            return [shape.generate_chunk(req, result, done, self.shaping)]
        if req.endpoint is Endpoint.COMPLETIONS:
            echoed = ""
            if req.echo and result.index < len(req.prompt_text):
                echoed = req.prompt_text[result.index] or ""
            offset = 0 if done == 1 else len(echoed) + len("".join(plan.pieces[: done - 1]))
            logprobs = shape.completion_logprobs(req, result, self.shaping, done - 1, done,
                                                 offset)
            text = (echoed if done == 1 else "") + piece
            return shape.with_transfer_params(
                [shape.completion_chunk(req, result.index, text, finish, logprobs)], result,
                last and self._final_params)
        logprobs = shape.chat_token_logprobs(req, result, self.shaping, done)
        chunks: list[dict[str, Any]] = []
        if done == 1:
            chunks.append(shape.chat_chunk(req, result.index, {"role": "assistant", "content": ""}))
        if piece or not last:
            chunks.append(shape.chat_chunk(req, result.index, {"content": piece}, finish, logprobs))
        else:
            chunks.append(shape.chat_chunk(req, result.index, {}, finish, logprobs))
        return shape.with_transfer_params(chunks, result, last and self._final_params)


    # -- admin ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The ``/sim/state`` document (:func:`cortex.sim.admin.sim_state`)."""
        return sim_state(self.config, self.engines, self.faults, self.ports,
                         self.seen.get("traceparent"))

    async def _sim_state(self, _: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def _sim_cache(self, request: web.Request) -> web.Response:
        with_tokens = request.query.get("tokens") in ("1", "true")
        return web.json_response(cache_listing(self.engines, self.config.block_size,
                                               with_tokens))

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
        self.notify_faults_changed()
        return web.json_response(self.faults.snapshot())

    async def _sim_restart(self, _: web.Request) -> web.Response:
        self._on_restart()
        return web.json_response(self.state())

    def notify_faults_changed(self) -> None:
        cap = self.faults.config.max_running
        for engine in self.engines:
            engine.admission.limit(cap or engine.config.max_running)
        self._faults_changed.set()
