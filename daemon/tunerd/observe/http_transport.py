"""A lean httpx transport for the once-a-second scrape of vLLM on loopback.

httpx's default transport (httpcore + h11, pure Python) costs ~0.3 ms of CPU per request here, of a
poll-cycle budget of ~0.7 ms (bench/poll_cost.py); the stdlib's `http.client` does the same keep-alive
GET for ~0.15 ms. This transport keeps httpx's API (timeouts, streaming, exceptions, MockTransport in
tests) and swaps only the wire code. Plain HTTP/1.1 only: vLLM is reached on 127.0.0.1.
"""

from __future__ import annotations

import http.client
import socket
from collections.abc import Iterator

import httpx


class _Body(httpx.SyncByteStream):
    def __init__(self, response: http.client.HTTPResponse, transport: LoopbackTransport) -> None:
        self._response = response
        self._transport = transport

    def __iter__(self) -> Iterator[bytes]:
        try:
            while chunk := self._response.read1(65536):
                yield chunk
        except TimeoutError as exc:
            self._transport.drop()
            raise httpx.ReadTimeout(str(exc)) from exc
        except (OSError, http.client.HTTPException) as exc:
            self._transport.drop()
            raise httpx.ReadError(str(exc)) from exc

    def close(self) -> None:
        if not self._response.isclosed():
            # A body not read to the end (e.g. abandoned because it was too big) poisons the connection.
            self._transport.drop()
        self._response.close()


class LoopbackTransport(httpx.BaseTransport):
    """One keep-alive connection, reopened when the server closes it. Not thread-safe (one poller)."""

    def __init__(self) -> None:
        self._conn: http.client.HTTPConnection | None = None
        self._origin: tuple[str, int] | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        origin = (request.url.host, request.url.port or 80)
        target = request.url.raw_path.decode("ascii")
        for attempt in (1, 2):  # a kept-alive connection the server closed meanwhile: retry once
            conn = self._connection(origin, timeouts)
            try:
                conn.request(request.method, target, headers=dict(request.headers))
                response = conn.getresponse()
                break
            except TimeoutError as exc:
                self.drop()
                raise httpx.ReadTimeout(str(exc)) from exc
            except (OSError, http.client.HTTPException) as exc:
                self.drop()
                if attempt == 2:
                    raise httpx.RemoteProtocolError(str(exc)) from exc
        return httpx.Response(
            response.status,
            headers=response.getheaders(),
            stream=_Body(response, self),
            extensions={"http_version": b"HTTP/1.1"},
        )

    def _connection(
        self, origin: tuple[str, int], timeouts: dict[str, float | None]
    ) -> http.client.HTTPConnection:
        if self._conn is None or self._origin != origin:
            self.drop()
            self._conn = http.client.HTTPConnection(origin[0], origin[1], timeout=timeouts.get("connect"))
            self._origin = origin
            try:
                self._conn.connect()
            except TimeoutError as exc:
                self.drop()
                raise httpx.ConnectTimeout(str(exc)) from exc
            except OSError as exc:
                self.drop()
                raise httpx.ConnectError(str(exc)) from exc
            self._conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._conn.sock is not None
        self._conn.sock.settimeout(timeouts.get("read"))
        return self._conn

    def drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def close(self) -> None:
        self.drop()
