"""Calls to workers over one aiohttp session per process; aiohttp errors end here.

:class:`UpstreamClient` opens a request and hands back the live response; the caller reads
it (streaming) and closes it. Closing before the end drops the connection, which is how the
engine learns that the client went away and aborts the generation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from enum import StrEnum
from types import TracebackType

import aiohttp

from cortex.gateway.config import UpstreamConfig

__all__ = ["FailureKind", "UpstreamClient", "UpstreamFailure", "UpstreamResponse"]


class FailureKind(StrEnum):
    CONNECT = "connect"
    TIMEOUT = "timeout"
    STATUS = "status"
    DISCONNECT = "disconnect"
    PROTOCOL = "protocol"


class UpstreamFailure(Exception):
    """A worker call failed; ``kind`` says how. Internal: never shown to clients as is."""

    def __init__(self, kind: FailureKind, detail: str, status: int | None = None) -> None:
        super().__init__(f"{kind.value}: {detail}")
        self.kind = kind
        self.status = status


def _translate(exc: BaseException) -> UpstreamFailure:
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return UpstreamFailure(FailureKind.TIMEOUT, "timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamFailure(FailureKind.CONNECT, type(exc).__name__)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError
                  | aiohttp.ClientOSError):
        return UpstreamFailure(FailureKind.DISCONNECT, type(exc).__name__)
    return UpstreamFailure(FailureKind.PROTOCOL, type(exc).__name__)


class UpstreamResponse:
    """A worker's response whose headers arrived; iterate :meth:`chunks`, then close."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type = response.headers.get("Content-Type", "application/json")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive; raises :class:`UpstreamFailure` if the worker fails."""
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc

    async def read(self) -> bytes:
        """The whole body; raises :class:`UpstreamFailure`."""
        try:
            return await self._response.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        """Release the connection: back to the pool when the body was read, else dropped."""
        if self._response.content.at_eof():
            self._response.release()
        else:
            self._response.close()

    def __repr__(self) -> str:
        return f"UpstreamResponse(status={self.status}, type={self.content_type!r})"


class UpstreamClient:
    """``async with UpstreamClient(config) as upstream``: the process's aiohttp session."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None

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

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> UpstreamResponse:
        """Send a POST and wait for the response headers (the caller's deadline applies).

        Raises :class:`UpstreamFailure` (connect, timeout, disconnect)."""
        try:
            response = await self.session.post(url, data=body, headers=headers)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise _translate(exc) from exc
        return UpstreamResponse(response)

    def __repr__(self) -> str:
        return f"UpstreamClient(open={self._session is not None})"
