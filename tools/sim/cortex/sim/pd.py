"""Prefill/decode handoff between sim processes: SGLang bootstrap rooms, vLLM remote blocks.

No KV tensors exist, so what moves is what a router could observe: *which* prefill process
computed *which* tokens for *which* room / request. A prefill sim owns a
:class:`KvTransferServer` (a ZMQ ROUTER side channel, like the engines' transfer agents);
an SGLang prefill also runs the :class:`BootstrapServer` (SGLang's ``/route`` HTTP server on
``--bootstrap-port``) through which decode workers find that side channel. A decode sim
uses :class:`KvTransferClient` to pull.

Side-channel frames (DEALER → ROUTER): ``[b"PULL", room]`` (SGLang: wait for the room's
KV) and ``[b"READ", request_id, msgpack(block_ids)]`` (vLLM: read held blocks). Replies:
``[b"KV", key, msgpack({token_ids, cached_tokens, block_ids})]`` or ``[b"ERR", key, reason]``.

Failure behaviour follows the engines: an unknown room never gets KV (the decode times
out after its waiting timeout, the prefill after its bootstrap timeout), an unreachable
bootstrap server fails the decode at once, an unknown vLLM request id or unreachable side
channel makes the vLLM decode recompute locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio
from aiohttp import web

from cortex.sim.sockets import bind_tcp, site_port

__all__ = [
    "BootstrapServer",
    "KvHandoff",
    "KvTransferClient",
    "KvTransferServer",
    "RoomTicket",
    "TransferError",
]

log = logging.getLogger(__name__)

_PULL, _READ, _KV, _ERR = b"PULL", b"READ", b"KV", b"ERR"
_SWEEP_S = 1.0


class TransferError(Exception):
    """The KV handoff failed (unreachable peer, unknown room/request, timeout).

    SGLang legs answer it with HTTP 500; a vLLM decode recomputes the prefill locally.
    """


@dataclass(frozen=True, slots=True)
class KvHandoff:
    """What the decode learns from the prefill: the tokens whose KV it now holds."""

    token_ids: tuple[int, ...]
    cached_tokens: int
    block_ids: tuple[int, ...] = ()

    def pack(self) -> bytes:
        data: bytes = msgpack.packb({"token_ids": list(self.token_ids),
                                     "cached_tokens": self.cached_tokens,
                                     "block_ids": list(self.block_ids)})
        return data

    @classmethod
    def unpack(cls, data: bytes) -> KvHandoff:
        try:
            obj = msgpack.unpackb(data)
            return cls(tuple(obj["token_ids"]), int(obj["cached_tokens"]),
                       tuple(obj.get("block_ids", ())))
        except (ValueError, KeyError, TypeError) as exc:
            raise TransferError(f"malformed KV handoff: {exc}") from exc


# -- SGLang bootstrap server --------------------------------------------------------------


class BootstrapServer:
    """SGLang's prefill bootstrap HTTP server (``/route``, ``/health``...).

    The sim registers its ranks itself (every DP rank behind the one side channel);
    ``PUT /route`` from elsewhere is accepted and recorded like the engine does.
    """

    def __init__(self, host: str, port: int, *, rank_ip: str, rank_port: int, page_size: int,
                 http_port: int, dp_size: int = 1) -> None:
        self._host = host
        self._want_port = port
        self._table: dict[tuple[int, int, int, int], dict[str, Any]] = {
            (dp_rank, 0, 0, 0): {"rank_ip": rank_ip, "rank_port": rank_port}
            for dp_rank in range(dp_size)
        }
        self._info = {
            "attn_tp_size": 1, "attn_cp_size": 1, "dp_size": dp_size, "pp_size": 1,
            "page_size": page_size, "kv_cache_dtype": "auto", "follow_bootstrap_room": True,
            "enable_dsa_cache_layer_split": False, "prefill_http_port": http_port,
        }
        self._room_dp: dict[int, int] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> BootstrapServer:
        app = web.Application()
        app.router.add_route("*", "/route", self._route)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        try:
            site = web.TCPSite(self._runner, self._host, self._want_port)
            await site.start()
            self.port = site_port(self._runner)
        except BaseException:
            await self._runner.cleanup()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route(self, request: web.Request) -> web.Response:
        if request.method == "PUT":
            try:
                data = await request.json()
                key = (int(data.get("system_dp_rank", data.get("attn_dp_rank", 0))),
                       int(data.get("attn_cp_rank", 0)), int(data["attn_tp_rank"]),
                       int(data.get("pp_rank", 0)))
                self._table[key] = {"rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
            except (ValueError, KeyError, TypeError):
                return web.Response(text="Bad registration", status=400)
            return web.Response(text="OK")
        if request.method != "GET":
            return web.Response(text="Method not allowed", status=405)
        names = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
        raw = [request.query.get(name) for name in names]
        if not all(raw):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        try:
            key4 = tuple(int(value or 0) for value in raw)
        except ValueError:
            return web.Response(text="Missing inputs for bootstrap server.", status=400)
        if key4 == (-1, -1, -1, -1):
            return web.json_response(self._info)
        info = self._table.get((key4[0], key4[1], key4[2], key4[3]))
        if info is None:
            return web.Response(text=f"Bootstrap info not found for dp_rank={key4[0]} "
                                f"cp_rank={key4[1]} tp_rank={key4[2]} pp_rank={key4[3]}",
                                status=404)
        return web.json_response(info)

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        data = await request.json()
        self._room_dp[int(data["bootstrap_room"])] = int(data["dp_rank"])
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        data = await request.json()
        rooms = [int(room) for room in data.get("bootstrap_rooms", [])]
        return web.json_response({str(r): self._room_dp[r] for r in rooms if r in self._room_dp})

    def __repr__(self) -> str:
        return f"BootstrapServer(port={self.port})"



# -- prefill side channel -----------------------------------------------------------------


@dataclass(eq=False)
class _Room:
    created: float
    handshake: asyncio.Future[bytes]
    claimed: bool = False


@dataclass(eq=False)
class _Held:
    handoff: KvHandoff
    release: Callable[[], None]
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class RoomTicket:
    """A prefill request's claim on an SGLang bootstrap room."""

    room: int
    _state: _Room
    _server: KvTransferServer
    sent: bool = field(default=False)

    async def wait_handshake(self, timeout_s: float) -> None:
        """Wait until the decode for this room has connected; ``TransferError`` on timeout."""
        try:
            await asyncio.wait_for(asyncio.shield(self._state.handshake), timeout_s)
        except TimeoutError:
            raise TransferError(
                f"Request {self.room} timed out after {timeout_s:.1f}s in "
                "KVPoll.Bootstrapping (no decode handshake for this bootstrap room)") from None

    async def send(self, handoff: KvHandoff) -> None:
        """Hand the computed KV to the waiting decode."""
        identity = self._state.handshake.result()
        await self._server._reply(identity, _KV, str(self.room).encode(), handoff.pack())
        self.sent = True


class KvTransferServer:
    """The prefill's KV side channel (ZMQ ROUTER on ``host:port``; 0 = any free port)."""

    def __init__(self, ctx: zmq.asyncio.Context, host: str, port: int, *,
                 room_timeout_s: float) -> None:
        self._ctx = ctx
        self._host = host
        self._want_port = port
        self._room_timeout_s = room_timeout_s
        self._sock: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._rooms: dict[int, _Room] = {}
        self._held: dict[str, _Held] = {}
        self.port = 0
        self.transfers = 0

    async def __aenter__(self) -> KvTransferServer:
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self.port = bind_tcp(self._sock, self._host, self._want_port)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self._tasks = [asyncio.create_task(self._serve(), name="sim-kv-transfer"),
                       asyncio.create_task(self._sweep(), name="sim-kv-sweep")]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        for held in list(self._held.values()):
            self._drop_held(held)
        self._held.clear()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    @contextlib.asynccontextmanager
    async def room(self, room: int) -> AsyncIterator[RoomTicket]:
        """Claim bootstrap ``room`` for one prefill request (released on exit)."""
        state = self._rooms.get(room)
        if state is None:
            state = _Room(created=time.monotonic(),
                          handshake=asyncio.get_running_loop().create_future())
            self._rooms[room] = state
        elif state.claimed:
            raise TransferError(f"bootstrap room {room} is already in use")
        state.claimed = True
        ticket = RoomTicket(room, state, self)
        try:
            yield ticket
        finally:
            self._rooms.pop(room, None)
            if not ticket.sent and state.handshake.done() and not state.handshake.cancelled():
                # Tell the waiting decode at once instead of letting it time out.
                with contextlib.suppress(zmq.ZMQError):
                    await self._reply(state.handshake.result(), _ERR, str(room).encode(),
                                      b"prefill aborted")
            if not state.handshake.done():
                state.handshake.cancel()

    def hold(self, request_id: str, handoff: KvHandoff, release: Callable[[], None],
             timeout_s: float) -> None:
        """Keep a vLLM prefill's blocks until a decode reads them or ``timeout_s`` passes."""
        held = _Held(handoff, release)
        old = self._held.pop(request_id, None)
        if old is not None:
            self._drop_held(old)
        held.timer = asyncio.get_running_loop().call_later(timeout_s, self._expire, request_id)
        self._held[request_id] = held

    def _expire(self, request_id: str) -> None:
        held = self._held.pop(request_id, None)
        if held is not None:
            log.warning("freeing blocks of %s: no decode read them in time", request_id)
            self._drop_held(held)

    def _drop_held(self, held: _Held) -> None:
        if held.timer is not None:
            held.timer.cancel()
        held.release()

    async def _reply(self, identity: bytes, kind: bytes, key: bytes, body: bytes) -> None:
        if self._sock is not None:
            await self._sock.send_multipart([identity, kind, key, body])

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            msg = await self._sock.recv_multipart()
            if len(msg) < 3:
                continue
            identity, kind, key = msg[0], msg[1], msg[2]
            if kind == _PULL:
                self._on_pull(identity, key)
            elif kind == _READ:
                await self._on_read(identity, key, msg[3] if len(msg) > 3 else b"")
            else:
                await self._reply(identity, _ERR, key, b"unknown request kind")

    def _on_pull(self, identity: bytes, key: bytes) -> None:
        try:
            room = int(key)
        except ValueError:
            return
        state = self._rooms.get(room)
        if state is None:
            # The decode may bootstrap before the prefill request arrives: keep it.
            state = _Room(created=time.monotonic(),
                          handshake=asyncio.get_running_loop().create_future())
            self._rooms[room] = state
        if not state.handshake.done():
            state.handshake.set_result(identity)

    async def _on_read(self, identity: bytes, key: bytes, body: bytes) -> None:
        request_id = key.decode(errors="replace")
        held = self._held.get(request_id)
        try:
            wanted = list(msgpack.unpackb(body)) if body else []
        except ValueError:
            wanted = []
        if held is None:
            await self._reply(identity, _ERR, key, b"unknown remote_request_id")
            return
        if wanted and wanted != list(held.handoff.block_ids):
            await self._reply(identity, _ERR, key, b"remote_block_ids do not match")
            return
        del self._held[request_id]
        await self._reply(identity, _KV, key, held.handoff.pack())
        self.transfers += 1
        self._drop_held(held)

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(_SWEEP_S)
            deadline = time.monotonic() - self._room_timeout_s
            for room, state in list(self._rooms.items()):
                if not state.claimed and state.created < deadline:
                    del self._rooms[room]

    def __repr__(self) -> str:
        return (f"KvTransferServer(port={self.port}, rooms={len(self._rooms)}, "
                f"held={len(self._held)})")


# -- decode side --------------------------------------------------------------------------


class KvTransferClient:
    """Pulls KV handoffs from prefill sims (a decode sim's half of the handshake)."""

    def __init__(self, ctx: zmq.asyncio.Context, session: aiohttp.ClientSession) -> None:
        self._ctx = ctx
        self._session = session

    async def pull_room(self, host: str, port: int, room: int, timeout_s: float, *,
                        prefill_dp_rank: int | None = None) -> KvHandoff:
        """SGLang decode: find the prefill's side channel via its bootstrap server, then wait
        for ``room``'s KV. The prefill's DP rank is ``prefill_dp_rank`` when the router gave
        it, else ``room % dp_size`` (SGLang's ``follow_bootstrap_room``). ``TransferError``
        when unreachable, refused or timed out."""
        deadline = time.monotonic() + timeout_s
        base = f"http://{_url_host(host)}:{port}/route"
        try:
            async with asyncio.timeout(timeout_s):
                info = await self._get_json(base, -1)
                if not isinstance(info, dict) or "page_size" not in info:
                    raise TransferError("bootstrap server returned no prefill info")
                dp_rank = prefill_dp_rank
                if dp_rank is None:
                    dp_rank = room % max(int(info.get("dp_size") or 1), 1)
                rank = await self._get_json(base, 0, dp_rank)
        except TimeoutError:
            raise TransferError(f"bootstrap server {host}:{port} timed out") from None
        try:
            rank_ip, rank_port = str(rank["rank_ip"]), int(rank["rank_port"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransferError(f"bad bootstrap info from {host}:{port}") from exc
        remaining = max(deadline - time.monotonic(), 0.001)
        return await self._exchange(rank_ip, rank_port, [_PULL, str(room).encode()], remaining,
                                    f"Request {room} timed out after {timeout_s:.1f}s in "
                                    "KVPoll.WaitingForInput")

    async def read_blocks(self, host: str, port: int, request_id: str, block_ids: list[int],
                          timeout_s: float) -> KvHandoff:
        """vLLM decode: read a prefill's held blocks. ``TransferError`` on any failure."""
        frames = [_READ, request_id.encode(), msgpack.packb(list(block_ids))]
        return await self._exchange(host, port, frames, timeout_s,
                                    f"KV read from {host}:{port} timed out")

    async def _get_json(self, base: str, rank: int, dp_rank: int | None = None) -> Any:
        """``GET /route`` for (dp, cp, tp, pp) = (``dp_rank`` or ``rank``, ``rank``…)."""
        params = {"prefill_dp_rank": str(rank if dp_rank is None else dp_rank),
                  "prefill_cp_rank": str(rank), "target_tp_rank": str(rank),
                  "target_pp_rank": str(rank)}
        try:
            async with self._session.get(base, params=params) as resp:
                if resp.status != 200:
                    text = await resp.text()
                    raise TransferError(f"bootstrap server answered {resp.status}: {text[:200]}")
                return await resp.json(content_type=None)
        except aiohttp.ClientError as exc:
            raise TransferError(f"cannot reach bootstrap server {base}: {exc}") from exc

    async def _exchange(self, host: str, port: int, frames: list[bytes], timeout_s: float,
                        timeout_message: str) -> KvHandoff:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(f"tcp://{_url_host(host)}:{port}")
            await sock.send_multipart(frames)
            try:
                async with asyncio.timeout(timeout_s):
                    reply = await sock.recv_multipart()
            except TimeoutError:
                raise TransferError(timeout_message) from None
        except zmq.ZMQError as exc:
            raise TransferError(f"KV side channel {host}:{port}: {exc}") from exc
        finally:
            sock.close(linger=0)
        if len(reply) < 3:
            raise TransferError("malformed side-channel reply")
        if reply[0] == _ERR:
            raise TransferError(reply[2].decode(errors="replace"))
        return KvHandoff.unpack(reply[2])


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
