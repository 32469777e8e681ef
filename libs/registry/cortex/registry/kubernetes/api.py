"""``PodApi``: list and watch pods over the Kubernetes API with aiohttp (the thin shell).

``list`` pages through ``GET /api/v1/namespaces/<ns>/pods?labelSelector=…&limit=…`` and
returns the list's ``resourceVersion``; ``watch`` resumes from one with
``watch=1&allowWatchBookmarks=true`` and yields the server's newline-delimited events until
the server ends the watch. ``410 Gone`` (as a status or an ``ERROR`` event) raises
:class:`ResourceVersionGone`; anything else that fails raises :class:`KubernetesUnavailable`.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from cortex.registry.kubernetes.errors import KubernetesUnavailable, ResourceVersionGone

__all__ = ["MAX_EVENT_BYTES", "LineSplitter", "PodApi", "WatchEvent", "ssl_context"]

MAX_EVENT_BYTES = 16 << 20
"""Largest watch event accepted (bytes); a pod with huge annotations is still far below."""

_PAGE = 500


@dataclass(frozen=True, slots=True)
class WatchEvent:
    kind: str  # ADDED, MODIFIED, DELETED, BOOKMARK
    obj: Mapping[str, Any]


class LineSplitter:
    """Bytes in, complete lines out (the watch stream's framing), bounded per line."""

    def __init__(self, max_line: int = MAX_EVENT_BYTES) -> None:
        self._buffer = bytearray()
        self._max = max_line

    def feed(self, data: bytes) -> list[bytes]:
        self._buffer += data
        *lines, rest = self._buffer.split(b"\n")
        if len(rest) > self._max:
            raise KubernetesUnavailable(f"a watch event exceeds {self._max} bytes")
        self._buffer = bytearray(rest)
        return [bytes(line) for line in lines if line.strip()]


def ssl_context(ca_file: str | None) -> ssl.SSLContext | None:
    """The context that trusts the cluster's CA (``None``: the system's)."""
    return ssl.create_default_context(cafile=ca_file) if ca_file else None


class PodApi:
    """The pods of one namespace that match one label selector."""

    def __init__(self, session: aiohttp.ClientSession, api_url: str, namespace: str,
                 selector: str, *, token_file: str | None = None,
                 tls: ssl.SSLContext | None = None, watch_timeout_s: float = 300.0) -> None:
        self._session = session
        self._url = f"{api_url.rstrip('/')}/api/v1/namespaces/{namespace}/pods"
        self._selector = selector
        self._token_file = token_file
        self._ssl: ssl.SSLContext | bool = tls if tls is not None else True
        self._watch_timeout_s = watch_timeout_s

    def __repr__(self) -> str:
        return f"PodApi(url={self._url!r}, selector={self._selector!r})"

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self._token_file:
            try:
                token = Path(self._token_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise KubernetesUnavailable(
                    f"cannot read the token file {self._token_file}: {exc.strerror}") from None
            headers["Authorization"] = f"Bearer {token}"
        return headers

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        """Every matching pod and the list's ``resourceVersion``."""
        pods: list[Mapping[str, Any]] = []
        params = {"labelSelector": self._selector, "limit": str(_PAGE)}
        timeout = aiohttp.ClientTimeout(total=30.0)
        while True:
            body = await self._get_json(params, timeout)
            pods.extend(p for p in body.get("items") or [] if isinstance(p, Mapping))
            meta = body.get("metadata") or {}
            if not meta.get("continue"):
                return pods, str(meta.get("resourceVersion") or "")
            params = {**params, "continue": str(meta["continue"])}

    async def _get_json(self, params: Mapping[str, str],
                        timeout: aiohttp.ClientTimeout) -> Mapping[str, Any]:
        try:
            async with self._session.get(self._url, params=params, headers=self._headers(),
                                         ssl=self._ssl, timeout=timeout) as resp:
                await _check(resp)
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise KubernetesUnavailable(f"pod list failed: {exc!r}") from exc
        if not isinstance(body, Mapping) or body.get("kind") != "PodList":
            raise KubernetesUnavailable("pod list: the answer is not a PodList")
        return body

    async def watch(self, resource_version: str) -> AsyncIterator[WatchEvent]:
        """Events after ``resource_version`` until the server ends the watch."""
        params = {"labelSelector": self._selector, "watch": "1",
                  "allowWatchBookmarks": "true", "resourceVersion": resource_version,
                  "timeoutSeconds": str(int(self._watch_timeout_s))}
        # the server ends the watch; a silent connection for much longer is a dead one
        timeout = aiohttp.ClientTimeout(total=None, connect=30.0,
                                        sock_read=self._watch_timeout_s + 30.0)
        splitter = LineSplitter()
        try:
            async with self._session.get(self._url, params=params, headers=self._headers(),
                                         ssl=self._ssl, timeout=timeout) as resp:
                await _check(resp)
                async for chunk in resp.content.iter_any():
                    for line in splitter.feed(chunk):
                        yield _event(line)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KubernetesUnavailable(f"pod watch failed: {exc!r}") from exc


async def _check(resp: aiohttp.ClientResponse) -> None:
    if resp.status == 410:
        raise ResourceVersionGone("410 Gone")
    if resp.status != 200:
        text = (await resp.text())[:200]
        raise KubernetesUnavailable(f"HTTP {resp.status}: {text}")


def _event(line: bytes) -> WatchEvent:
    try:
        data = json.loads(line)
    except ValueError:
        raise KubernetesUnavailable("a watch event is not JSON") from None
    kind = data.get("type") if isinstance(data, Mapping) else None
    obj = data.get("object") if isinstance(data, Mapping) else None
    if not isinstance(kind, str) or not isinstance(obj, Mapping):
        raise KubernetesUnavailable("a watch event lacks type or object")
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise ResourceVersionGone(str(obj.get("message") or "410 Gone"))
        raise KubernetesUnavailable(f"watch error: {obj.get('code')} {obj.get('message')}")
    return WatchEvent(kind, obj)
