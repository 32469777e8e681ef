"""Calls to workers over one aiohttp session per process; aiohttp errors end here.

:class:`UpstreamClient` opens a request and hands back the live response; the caller reads
it (streaming) and closes it. Closing before the end drops the connection, which is how the
engine learns that the client went away and aborts the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping
from enum import StrEnum
from types import TracebackType
from typing import Protocol

import aiohttp

from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.http.auth import WorkerCredentials
from cortex.registry.spec import WorkerSpec

__all__ = ["FailureKind", "Response", "Upstream", "UpstreamClient", "UpstreamFailure",
           "UpstreamResponse"]


class FailureKind(StrEnum):
    CONNECT = "connect"
    TIMEOUT = "timeout"
    STATUS = "status"
    DISCONNECT = "disconnect"
    PROTOCOL = "protocol"
    WEDGED = "wedged"  # no first byte nor engine progress, probe unanswered (dispatch.attempt)
    BAD_ANSWER = "bad_answer"  # a 200 whose body is not what the endpoint promises
    TOO_LARGE = "too_large"  # an answer over upstream.max_answer_bytes


class UpstreamFailure(Exception):
    """A worker call failed; ``kind`` says how (``status``: the HTTP status it answered,
    ``retry_after_s``: its ``Retry-After``). Internal: never shown to clients as is."""

    def __init__(self, kind: FailureKind, detail: str, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.status = status
        self.retry_after_s = retry_after_s


def _retry_after(value: str | None) -> float | None:
    """A ``Retry-After`` in seconds (the HTTP-date form is ignored)."""
    if value is None or not value.strip().isdigit():
        return None
    return float(value.strip())


def _translate(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamFailure(FailureKind.TIMEOUT, "timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailure(FailureKind.CONNECT, type(exc).__name__)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError):
        return UpstreamFailure(FailureKind.DISCONNECT, type(exc).__name__)
    return UpstreamFailure(FailureKind.PROTOCOL, type(exc).__name__)


class _IdleGuard:
    """Closes a response whose read has waited ``idle_s`` seconds for bytes.

    Only time spent waiting on the worker counts (not time the consumer spends sending to a
    slow client), and it costs one timer per idle period, not one per chunk."""

    __slots__ = ("_handle", "_loop", "_on_idle", "fired", "idle_s", "since")

    def __init__(self, idle_s: float, on_idle: Callable[[], None]) -> None:
        self._loop = asyncio.get_running_loop()
        self.idle_s = idle_s
        self._on_idle = on_idle
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None  # loop time the pending read started
        self.fired = False

    def reading(self) -> None:
        self.since = self._loop.time()
        if self._handle is None:
            self._handle = self._loop.call_at(self.since + self.idle_s, self._check)

    def got(self) -> None:
        self.since = None

    def _check(self) -> None:
        self._handle = None
        since = self.since
        if since is None:
            return  # not reading: re-armed by the next read
        if self._loop.time() - since >= self.idle_s:
            self.fired = True
            self._on_idle()
        else:
            self._handle = self._loop.call_at(since + self.idle_s, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class Response(Protocol):
    """What dispatch needs of a worker's response (:class:`UpstreamResponse`, or an
    in-memory one in unit tests)."""

    status: int
    content_type: str
    retry_after_s: float | None

    def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    """What dispatch needs of the worker client (:class:`UpstreamClient`, or an in-memory
    one in unit tests)."""

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   worker: WorkerSpec | None = None) -> Response: ...


class UpstreamResponse:
    """A worker's response whose headers arrived; iterate :meth:`chunks`, then close.
    :meth:`read` holds at most ``max_bytes`` of it (``None``: no bound)."""

    def __init__(self, response: aiohttp.ClientResponse, max_bytes: int | None = None) -> None:
        self._response = response
        self.max_bytes = max_bytes
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")
        self.retry_after_s = _retry_after(response.headers.get("Retry-After"))

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        """Body bytes as they arrive; raises :class:`UpstreamFailure` if the worker fails,
        or (kind ``timeout``) when it sends nothing for ``idle_timeout_s`` seconds (the
        connection is then closed: the engine aborts the request). A caller that stops
        before the end closes it (``contextlib.aclosing``): else the event loop's finalizer
        does, later, through a thread-safe wake-up and a task of its own."""
        content = self._response.content
        guard = (_IdleGuard(idle_timeout_s, self._response.close)
                 if idle_timeout_s is not None else None)
        try:
            while True:
                if guard is not None:
                    guard.reading()
                chunk = await content.readany()
                if guard is not None:
                    guard.got()
                if not chunk:
                    break
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            if guard is not None and guard.fired:
                raise UpstreamFailure(FailureKind.TIMEOUT,
                                      f"no bytes for {idle_timeout_s}s") from exc
            raise _translate(exc) from exc
        finally:
            if guard is not None:
                guard.cancel()
        if guard is not None and guard.fired:
            raise UpstreamFailure(FailureKind.TIMEOUT, f"no bytes for {idle_timeout_s}s")

    async def read(self) -> bytes:
        """The whole body; raises :class:`UpstreamFailure` (kind ``too_large`` when it
        announces or reaches more than ``max_bytes``: then nothing more is read)."""
        limit = self.max_bytes
        declared = self._response.content_length
        if limit is not None and declared is not None and declared > limit:
            raise UpstreamFailure(FailureKind.TOO_LARGE, f"{declared} bytes announced")
        parts: list[bytes] = []
        size = 0
        content = self._response.content
        try:
            while chunk := await content.readany():
                size += len(chunk)
                if limit is not None and size > limit:
                    raise UpstreamFailure(FailureKind.TOO_LARGE, f"over {limit} bytes")
                parts.append(chunk)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc
        return parts[0] if len(parts) == 1 else b"".join(parts)  # the one copy

    def close(self) -> None:
        """Release the connection: back to the pool when the body was read, else dropped."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()

    def __repr__(self) -> str:
        return f"UpstreamResponse(status={self.status}, type={self.content_type!r})"


class UpstreamClient:
    """``async with UpstreamClient(config) as upstream``: the process's aiohttp session.

    ``credentials``: the workers' API keys; :meth:`auth` gives the headers for one."""

    def __init__(self, config: UpstreamConfig,
                 credentials: WorkerCredentials | None = None) -> None:
        self.config = config
        self.credentials = credentials or WorkerCredentials({})
        self._session: aiohttp.ClientSession | None = None

    def auth(self, spec: WorkerSpec) -> dict[str, str]:
        """``Authorization`` for ``spec``'s worker (``{}`` when it needs none)."""
        return self.credentials.headers(spec)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("UpstreamClient used outside its async with block")
        return self._session

    async def __aenter__(self) -> UpstreamClient:
        connector = aiohttp.TCPConnector(
            limit=self.config.max_connections, limit_per_host=0, keepalive_timeout=30.0,
            enable_cleanup_closed=False,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
            auto_decompress=False,
            # bodies are relayed as they come: never ask a worker to compress them
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
            # workers' cookies must never flow from one client's request into another's
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   worker: WorkerSpec | None = None) -> UpstreamResponse:
        """Send a POST (to ``worker``: with its credential) and wait for the response
        headers (the caller's deadline applies).

        Raises :class:`UpstreamFailure` (connect, timeout, disconnect)."""
        return await self.request("POST", url, body, headers, worker)

    async def request(self, method: str, url: str, body: bytes | None,
                      headers: Mapping[str, str], worker: WorkerSpec | None = None
                      ) -> UpstreamResponse:
        """:meth:`post` for any method (``body`` ``None``: none)."""
        if worker is not None and worker.credential is not None:
            headers = {**headers, **self.auth(worker)}
        try:
            response = await self.session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc
        return UpstreamResponse(response, self.config.max_answer_bytes)

    def __repr__(self) -> str:
        return f"UpstreamClient(open={self._session is not None})"
