"""A lean httpx transport for the once-a-second scrape of vLLM on loopback: HTTP/1.1 over one socket.

Why not httpx's default transport or `http.client`: per keep-alive GET of vLLM's filtered /metrics
(10–14 kB, chunked) on a 2-core CPU host, in CPU time (user + system, `time.process_time_ns`) against
real vLLM 0.32, back to back: httpcore + h11 ~0.3 ms, `http.client` ~0.19–0.26 ms (its `email.feedparser`
header parsing and `read1` chunk loop dominate), the bare socket exchange ~0.03 ms, this transport
~0.07 ms. It does that exchange plus the little parsing HTTP/1.1 needs, and keeps httpx's API above it
(timeouts, streaming, exceptions, MockTransport in tests). Two more savings: timeouts are the kernel's
(SO_RCVTIMEO/SO_SNDTIMEO on a blocking socket, no poll() before each send and recv), and the bytes of a
request sent again unchanged are reused.

`LoopbackClient` is the httpx.Client to use it with: it also skips httpx's cookie extraction, which
wraps every response and its request into `urllib` objects (re-parsing the 1.3 kB filtered URL) only to
find no Set-Cookie header: ~80 µs of CPU per poll with cold caches, a fifth of a scrape.

What it speaks: plain `http://` only (vLLM is reached on 127.0.0.1), one request at a time on one
keep-alive connection (not thread-safe: one poller owns it). Responses framed by Content-Length,
`Transfer-Encoding: chunked` or connection close; interim 1xx responses skipped; no body for HEAD, 204
and 304. Request bodies are sent whole (`request.read()`), chunk-encoded when the request says chunked.

Errors are httpx's: ConnectError/ConnectTimeout opening the socket, WriteError/WriteTimeout sending,
ReadError/ReadTimeout receiving, RemoteProtocolError for a malformed or cut response,
UnsupportedProtocol for another scheme, LocalProtocolError for a header with CR or LF. A kept-alive
connection that the server closed meanwhile (it closes before any byte of the response) is reopened and
the request sent once more. After any error, and after a body not read to its end, the connection is
dropped; the next request opens a fresh one.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Iterator
from typing import Any

import httpx

__all__ = ["LoopbackClient", "LoopbackTransport"]

_RECV = 65536
_MAX_HEAD = 64 << 10  # a response head larger than this is not a server we want to talk to
_MAX_LINE = 4096  # a chunk-size or trailer line
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) ([1-9][0-9][0-9])(?: ([^\r\n]*))?")
_NO_BODY_STATUS = frozenset({204, 304})
_LENGTH, _CHUNKED, _UNTIL_CLOSE = range(3)


class _ProtocolError(Exception):
    """The server broke HTTP/1.1 framing (mapped to httpx.RemoteProtocolError)."""


class _Stale(Exception):
    """The connection closed before any byte of the response: a kept-alive one may be retried."""


class _Connection:
    """One keep-alive socket to `origin` (host, port)."""

    __slots__ = ("busy", "origin", "sock", "timeouts", "used")

    def __init__(self, origin: tuple[str, int], sock: socket.socket) -> None:
        self.origin = origin
        self.sock = sock
        self.used = False  # True once a response was read completely on it (so it was kept alive)
        self.busy = False  # a response on it is not over yet: it can't carry another request
        self.timeouts: tuple[float | None, float | None] | None = None  # (read, write) set on the socket

    def set_timeouts(self, read: float | None, write: float | None) -> None:
        """Kernel-side timeouts (SO_RCVTIMEO, SO_SNDTIMEO) on the blocking socket: an expired one makes
        recv/send fail with EAGAIN (BlockingIOError). Python's own socket timeout would instead poll()
        before every send and recv: 3 more syscalls per request (~8 µs of CPU per poll, cold caches)."""
        if self.timeouts != (read, write):
            for option, seconds in ((socket.SO_RCVTIMEO, read), (socket.SO_SNDTIMEO, write)):
                self.sock.setsockopt(socket.SOL_SOCKET, option, _timeval(seconds))
            self.timeouts = (read, write)

    def recv(self, size: int = _RECV) -> bytes:
        data = self.sock.recv(size)
        if not data:
            raise _ProtocolError("server closed the connection inside the response")
        return data


def _timeval(seconds: float | None) -> bytes:
    # struct timeval; all zeros means no timeout. A zero timeout would mean none at all: make it 1 µs.
    micros = 0 if seconds is None else max(1, round(seconds * 1e6))
    return struct.pack("@ll", micros // 1_000_000, micros % 1_000_000)


def _request_bytes(request: httpx.Request) -> bytes:
    """The request as it goes on the wire: request line, httpx's headers (Host included), body."""
    parts = [request.method.encode("ascii"), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    chunked = False
    raw = request.headers.raw
    for name, value in raw:
        parts += (name, b": ", value, b"\r\n")
        if name.lower() == b"transfer-encoding":
            chunked = True
    parts.append(b"\r\n")
    head = b"".join(parts)
    # Exactly the CRLFs put in above, no stray CR, LF or NUL from a header value (request smuggling).
    lines = len(raw) + 2
    if head.count(b"\n") != lines or head.count(b"\r") != lines or b"\0" in head or b" " in parts[2]:
        raise httpx.LocalProtocolError("CR, LF, NUL or space in the request target or a header")
    body = request.read()
    if chunked:
        body = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    return head + body


class _Head:
    """A parsed response head and how its body is framed."""

    __slots__ = ("framing", "headers", "keep_alive", "length", "reason", "status")

    def __init__(self, block: bytes, method: str) -> None:
        status_line, *lines = block.split(b"\r\n")
        match = _STATUS_LINE.fullmatch(status_line)
        if match is None:
            raise _ProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        minor, code, reason = match.groups()
        self.status = int(code)
        self.reason = reason or b""
        self.headers: list[tuple[bytes, bytes]] = []
        lengths: set[bytes] = set()
        codings: list[bytes] = []
        tokens: set[bytes] = set()
        for line in lines:
            name, sep, value = line.partition(b":")
            # No name, whitespace before the colon, or obsolete line folding: refuse (RFC 9112 §5).
            if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                raise _ProtocolError(f"malformed header line {line[:80]!r}")
            value = value.strip(b" \t")
            self.headers.append((name, value))
            lname = name.lower()
            if lname == b"content-length":
                lengths.add(value)
            elif lname == b"transfer-encoding":
                codings += (c.strip().lower() for c in value.split(b","))
            elif lname == b"connection":
                tokens.update(t.strip().lower() for t in value.split(b","))
        self.keep_alive = b"close" not in tokens and (minor == b"1" or b"keep-alive" in tokens)
        self.length = 0
        if method == "HEAD" or self.status in _NO_BODY_STATUS or self.status < 200:
            self.framing = _LENGTH
        elif codings:
            # RFC 9112 §6.3: Transfer-Encoding wins over Content-Length; chunked must be the last coding,
            # else the body runs to the close. With both present the connection can't be trusted after.
            self.framing = _CHUNKED if codings[-1] == b"chunked" else _UNTIL_CLOSE
            self.keep_alive = self.keep_alive and self.framing == _CHUNKED and not lengths
        elif lengths:
            if len(lengths) > 1 or not next(iter(lengths)).isdigit():
                raise _ProtocolError(f"bad Content-Length {sorted(lengths)!r}")
            self.framing, self.length = _LENGTH, int(next(iter(lengths)))
        else:
            self.framing, self.keep_alive = _UNTIL_CLOSE, False


class _Body(httpx.SyncByteStream):
    """The response body, read from the socket as the caller iterates. Reading it to its end hands the
    connection back for the next request; closing it earlier drops the connection."""

    def __init__(self, transport: LoopbackTransport, conn: _Connection, head: _Head, pending: bytes) -> None:
        self._transport = transport
        self._conn = conn
        self._head = head
        self._pending = pending
        self._done = False
        if head.framing == _LENGTH and head.length == 0:
            self._finish(pending)

    def __iter__(self) -> Iterator[bytes]:
        if self._done:
            return
        head = self._head
        try:
            if head.framing == _LENGTH:
                yield from self._sized(head.length)
            elif head.framing == _CHUNKED:
                yield from self._chunked()
            else:
                yield from self._until_close()
        except BlockingIOError as exc:  # SO_RCVTIMEO expired; before OSError: it is one
            self._transport._release(self._conn, False)
            raise httpx.ReadTimeout("timed out") from exc
        except OSError as exc:
            self._transport._release(self._conn, False)
            raise httpx.ReadError(str(exc)) from exc
        except _ProtocolError as exc:
            self._transport._release(self._conn, False)
            raise httpx.RemoteProtocolError(str(exc)) from exc

    def _finish(self, leftover: bytes) -> None:
        self._done = True
        # Bytes past the end of the response were never asked for: the connection is out of step.
        self._transport._release(self._conn, self._head.keep_alive and not leftover)

    def _sized(self, length: int) -> Iterator[bytes]:
        buf, leftover = self._pending[:length], self._pending[length:]
        remaining = length - len(buf)
        if buf:
            yield buf
        while remaining:
            data = self._conn.recv(min(remaining, _RECV))
            remaining -= len(data)
            yield data
        self._finish(leftover)

    def _line(self, buf: bytes) -> tuple[bytes, bytes]:
        while (end := buf.find(b"\r\n")) < 0:
            if len(buf) > _MAX_LINE:
                raise _ProtocolError("chunk-size or trailer line too long")
            buf += self._conn.recv()
        return buf[:end], buf[end + 2 :]

    def _chunked(self) -> Iterator[bytes]:
        buf = self._pending
        while True:
            line, buf = self._line(buf)
            size_text = line.split(b";", 1)[0].strip(b" \t")
            if _HEX.fullmatch(size_text) is None:
                raise _ProtocolError(f"bad chunk size line {line[:40]!r}")
            remaining = int(size_text, 16)
            if remaining == 0:
                break
            while remaining:  # yield as it arrives: the caller may stop a body that grows too large
                if not buf:
                    buf = self._conn.recv()
                piece, buf = buf[:remaining], buf[remaining:]
                remaining -= len(piece)
                yield piece
            while len(buf) < 2:
                buf += self._conn.recv()
            if buf[:2] != b"\r\n":
                raise _ProtocolError("chunk data not followed by CRLF")
            buf = buf[2:]
        while True:  # trailer fields, ignored, up to the empty line
            line, buf = self._line(buf)
            if not line:
                break
        self._finish(buf)

    def _until_close(self) -> Iterator[bytes]:
        if self._pending:
            yield self._pending
        while data := self._conn.sock.recv(_RECV):
            yield data
        self._done = True
        self._transport._release(self._conn, False)

    def close(self) -> None:
        if not self._done:
            # A body not read to the end (e.g. abandoned because it was too big) poisons the connection.
            self._done = True
            self._transport._release(self._conn, False)


class LoopbackTransport(httpx.BaseTransport):
    """One keep-alive HTTP/1.1 connection, reopened when needed. Not thread-safe (one poller)."""

    def __init__(self) -> None:
        self._conn: _Connection | None = None
        # The last request sent, with its URL, method and headers then, and its bytes: a poller sends the
        # same request every time, and building its bytes (the 1.3 kB URL encoded) is ~10 µs of CPU.
        self._sent: tuple[httpx.Request, httpx.URL, str, list[tuple[bytes, bytes]], bytes] | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"LoopbackTransport speaks plain http, not {url.scheme!r}")
        timeouts = request.extensions.get("timeout", {})
        origin = (url.host, url.port or 80)
        sent, headers = self._sent, request.headers.raw
        if sent is not None and sent[:3] == (request, url, request.method) and sent[3] == headers:
            wire = sent[4]  # the body, if any, is `request.read()`'s: cached by the request itself
        else:
            wire = _request_bytes(request)
            self._sent = (request, url, request.method, headers, wire)
        for attempt in (1, 2):
            conn = self._connection(origin, timeouts.get("connect"))
            try:
                head, pending = self._exchange(conn, wire, request.method, timeouts)
                break
            except _Stale:
                self._release(conn, False)
                if attempt == 2 or not conn.used:
                    raise httpx.RemoteProtocolError("server closed the connection, no response") from None
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=_Body(self, conn, head, pending),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": head.reason},
        )

    def _exchange(
        self, conn: _Connection, wire: bytes, method: str, timeouts: dict[str, float | None]
    ) -> tuple[_Head, bytes]:
        """Send `wire`, read up to the end of the final (non-1xx) response head."""
        sock = conn.sock
        try:
            conn.set_timeouts(timeouts.get("read"), timeouts.get("write"))
            sock.sendall(wire)
        except BlockingIOError as exc:  # SO_SNDTIMEO expired
            self._release(conn, False)
            raise httpx.WriteTimeout("timed out") from exc
        except OSError as exc:
            if conn.used:  # most likely the server closed the idle connection: worth one more try
                raise _Stale from exc
            self._release(conn, False)
            raise httpx.WriteError(str(exc)) from exc
        buf = b""
        try:
            while True:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _MAX_HEAD:
                        raise _ProtocolError(f"response head over {_MAX_HEAD} bytes")
                    data = sock.recv(_RECV)
                    if not data:
                        if buf:
                            raise _ProtocolError("server closed the connection inside the response head")
                        raise _Stale
                    buf += data
                    continue
                head = _Head(buf[:end], method)
                buf = buf[end + 4 :]
                if head.status >= 200:
                    return head, buf
                if head.status == 101:
                    raise _ProtocolError("101 Switching Protocols is not supported")
                # 100 Continue, 103 Early Hints: an interim response; the real one follows.
        except BlockingIOError as exc:  # SO_RCVTIMEO expired
            self._release(conn, False)
            raise httpx.ReadTimeout("timed out") from exc
        except ConnectionResetError as exc:
            if not buf:
                raise _Stale from exc
            self._release(conn, False)
            raise httpx.ReadError(str(exc)) from exc
        except OSError as exc:
            self._release(conn, False)
            raise httpx.ReadError(str(exc)) from exc
        except _ProtocolError as exc:
            self._release(conn, False)
            raise httpx.RemoteProtocolError(str(exc)) from exc

    def _connection(self, origin: tuple[str, int], timeout: float | None) -> _Connection:
        conn = self._conn
        if conn is not None and conn.origin == origin and not conn.busy:
            conn.busy = True
            return conn
        self.close()
        try:
            sock = socket.create_connection(origin, timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        # The request goes out in one send; don't let Nagle hold a second segment back.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking: timeouts are the kernel's (`_Connection.set_timeouts`)
        self._conn = _Connection(origin, sock)
        self._conn.busy = True
        return self._conn

    def _release(self, conn: _Connection, reusable: bool) -> None:
        """A response on `conn` is over: keep the connection for the next request, or close it."""
        if reusable:
            conn.used, conn.busy = True, False
            return
        conn.sock.close()
        if self._conn is conn:
            self._conn = None

    def close(self) -> None:
        if self._conn is not None:
            self._release(self._conn, False)


class _IgnoredCookies(httpx.Cookies):
    """Cookies set by hand are sent as usual; those a response sets are ignored, without looking."""

    def extract_cookies(self, response: httpx.Response) -> None:
        return None


class LoopbackClient(httpx.Client):
    """An httpx.Client over a `LoopbackTransport` that ignores cookies set by responses (vLLM sets none)
    and the environment's proxy settings (`trust_env=False`: vLLM is on loopback). Other arguments are
    httpx.Client's."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(transport=LoopbackTransport(), trust_env=False, **kwargs)  # type: ignore[arg-type]
        self._ignored_cookies = _IgnoredCookies()

    @property  # type: ignore[override]
    def cookies(self) -> httpx.Cookies:
        # httpx calls `self.cookies.extract_cookies(response)` for every response.
        return self._ignored_cookies

    @cookies.setter
    def cookies(self, cookies: Any) -> None:
        self._ignored_cookies = _IgnoredCookies(cookies)
