"""What the gateway's HTTP/1.1 server puts on the wire, at less CPU than hypercorn's defaults.

Two per-response costs of hypercorn + h11 that the gateway's answers (a dozen headers each:
``x-request-id``, the ``x-cortex-*`` decision headers, the SSE ones) made visible:

- h11 checks every header of a response against its grammar when the response event is
  built, then again, all of them, each time it sets a framing header (``Content-Length``
  cleared and ``Transfer-Encoding: chunked`` set for a stream: two more passes).
  :class:`LeanH11Connection` checks them once: its framing step edits the already checked
  headers and adds only its own constant ones. The bytes sent are the same
  (``tests/gateway/http/test_wire.py`` compares both connections over the cases h11 treats
  apart);
- hypercorn formats the ``Date`` header anew for each response; :class:`CachedDateConfig` formats
  it once per second (its resolution).
"""

from __future__ import annotations

import time
from typing import cast
from wsgiref.handlers import format_date_time

import h11
from h11._connection import _body_framing
from h11._headers import Headers, get_comma_header
from hypercorn.config import Config as HypercornConfig

__all__ = ["CachedDateConfig", "LeanH11Connection"]


def _set_checked(headers: Headers, name: bytes, values: list[bytes]) -> Headers:
    """h11's ``set_comma_header`` for headers it already checked and constant ``values``
    (lower-case, valid): the same items, without checking all of them again."""
    items = [item for item in headers._full_items if item[1] != name]
    raw = name.title()
    items += [(raw, name, value) for value in values]
    return Headers(items)


class LeanH11Connection(h11.Connection):
    """An ``h11.Connection`` whose responses' headers are checked once (when the
    ``h11.Response`` is built), not again at each framing header it sets."""

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        # h11 0.16's method, with _set_checked for set_comma_header
        headers = response.headers
        need_close = False
        method = cast(bytes, self._request_method)
        if method == b"HEAD":
            method = b"GET"
        framing_type, _ = _body_framing(method, response)
        if framing_type in ("chunked", "http/1.0"):
            headers = _set_checked(headers, b"content-length", [])
            if self.their_http_version is None or self.their_http_version < b"1.1":
                headers = _set_checked(headers, b"transfer-encoding", [])
                if self._request_method != b"HEAD":
                    need_close = True
            else:
                headers = _set_checked(headers, b"transfer-encoding", [b"chunked"])
        if not self._cstate.keep_alive or need_close:
            connection = set(get_comma_header(headers, b"connection"))
            connection.discard(b"keep-alive")
            connection.add(b"close")
            headers = _set_checked(headers, b"connection", sorted(connection))
        return h11.Response(headers=headers, status_code=response.status_code,
                            http_version=response.http_version, reason=response.reason)


class CachedDateConfig(HypercornConfig):
    """hypercorn's config with the ``Date`` header formatted once per second."""

    _date_second = -1
    _date = b""

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        if (not self.include_date_header or self.include_server_header
                or self.alt_svc_headers or self._quic_addresses):
            return super().response_headers(protocol)
        second = int(time.time())
        if second != self._date_second:
            self._date = format_date_time(second).encode("ascii")  # what hypercorn writes
            self._date_second = second
        return [(b"date", self._date)]
