"""Calls to workers; aiohttp errors end here.

:class:`UpstreamClient` opens a request and hands back the live response; the caller reads
it (streaming) and closes it. Closing before the end drops the connection, which is how the
engine learns that the client went away and aborts the generation. Plain-HTTP workers are
called through the lean HTTP/1.1 pool of :mod:`cortex.gateway.upstream.h1`
(``upstream.http_client: lean``, the default), ``https`` ones (and every worker with
``http_client: aiohttp``) through one aiohttp session per process.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Mapping
from types import TracebackType
from typing import Protocol

import aiohttp

from cortex.gateway.config.gateway import UpstreamConfig
from cortex.gateway.http.auth import WorkerCredentials
from cortex.gateway.upstream.errors import FailureKind, UpstreamFailure
from cortex.gateway.upstream.h1 import H1Pool, IdleGuard, retry_after
from cortex.registry.spec import WorkerSpec

__all__ = ["FailureKind", "Response", "Upstream", "UpstreamClient", "UpstreamFailure",
           "UpstreamResponse"]


def _translate(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamFailure(FailureKind.TIMEOUT, "timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailure(FailureKind.CONNECT, type(exc).__name__)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError):
        return UpstreamFailure(FailureKind.DISCONNECT, type(exc).__name__)
    return UpstreamFailure(FailureKind.PROTOCOL, type(exc).__name__)


class Response(Protocol):
    """What dispatch needs of a worker's response (:class:`UpstreamResponse`,
    :class:`~cortex.gateway.upstream.h1.H1Response`, or an in-memory one in unit tests)."""

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
        self.retry_after_s = retry_after(response.headers.get("Retry-After"))

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        """Body bytes as they arrive; raises :class:`UpstreamFailure` if the worker fails,
        or (kind ``timeout``) when it sends nothing for ``idle_timeout_s`` seconds (the
        connection is then closed: the engine aborts the request). A caller that stops
        before the end closes it (``contextlib.aclosing``): else the event loop's finalizer
        does, later, through a thread-safe wake-up and a task of its own."""
        content = self._response.content
        guard = (IdleGuard(idle_timeout_s, self._response.close)
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
        self._h1: H1Pool | None = None

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
        if self.config.http_client == "lean":
            self._h1 = H1Pool(connect_timeout_s=self.config.connect_timeout_s,
                              max_connections=self.config.max_connections)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        h1, self._h1 = self._h1, None
        if h1 is not None:
            h1.close()
        if session is not None:
            await session.close()

    async def post(self, url: str, body: bytes, headers: Mapping[str, str],
                   worker: WorkerSpec | None = None) -> Response:
        """Send a POST (to ``worker``: with its credential) and wait for the response
        headers (the caller's deadline applies).

        Raises :class:`UpstreamFailure` (connect, timeout, disconnect)."""
        return await self.request("POST", url, body, headers, worker)

    async def get(self, url: str, headers: Mapping[str, str]) -> tuple[int, bytes]:
        """A small ``GET`` read whole (a probe, a load poll): (status, body). Raises
        :class:`UpstreamFailure`; the caller's deadline applies."""
        response = await self.request("GET", url, None, headers)
        try:
            return response.status, await response.read()
        finally:
            response.close()

    async def request(self, method: str, url: str, body: bytes | None,
                      headers: Mapping[str, str], worker: WorkerSpec | None = None
                      ) -> Response:
        """:meth:`post` for any method (``body`` ``None``: none)."""
        if worker is not None and worker.credential is not None:
            headers = {**headers, **self.auth(worker)}
        if self._h1 is not None and url.startswith("http://"):
            return await self._h1.request(method, url, body, headers,
                                          self.config.max_answer_bytes)
        try:
            response = await self.session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc
        return UpstreamResponse(response, self.config.max_answer_bytes)

    def __repr__(self) -> str:
        return f"UpstreamClient(open={self._session is not None}, lean={self._h1!r})"
