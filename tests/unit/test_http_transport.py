"""http_transport: the loopback HTTP/1.1 transport against a real local stdlib HTTP server — keep-alive,
every body framing, a server that drops idle connections, and each failure mapped to httpx's errors."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tunerd.observe.http_transport import LoopbackClient, LoopbackTransport


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive unless a response says otherwise

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, body: bytes, *headers: tuple[str, str], status: int = 200) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        peer = f"{self.client_address[1]}".encode()  # the client's port: which connection this is
        if path == "/length":
            self._send(b"hello " + peer, ("Content-Length", str(6 + len(peer))), ("Set-Cookie", "a=b"))
        elif path == "/chunked":
            chunks = b"5\r\nhello\r\n1;ext=1\r\n \r\n" + b"%x\r\n%s\r\n" % (len(peer), peer)
            self._send(chunks + b"0\r\nX: y\r\n\r\n", ("Transfer-Encoding", "chunked"))  # with a trailer
        elif path == "/until-close":
            self.close_connection = True
            self._send(b"all of it", ("Connection", "close"))
        elif path == "/drop-after":  # keep-alive promised, then the server closes the idle connection
            self.close_connection = True
            self._send(peer, ("Content-Length", str(len(peer))))
        elif path == "/status":
            self._send(b"nope", ("Content-Length", "4"), status=503)
        elif path == "/interim":
            self.wfile.write(b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n")
            self._send(b"ok", ("Content-Length", "2"))
        elif path == "/slow":
            time.sleep(0.5)
            self._send(b"late", ("Content-Length", "4"))
        elif path == "/garbage":
            self.close_connection = True
            self.wfile.write(b"<html>not http</html>\r\n\r\n")
        elif path == "/cut":
            self.close_connection = True
            self._send(b"short", ("Content-Length", "100"))
        elif path == "/bad-chunk":
            self.close_connection = True
            self._send(b"zz\r\nhello\r\n0\r\n\r\n", ("Transfer-Encoding", "chunked"))
        elif path == "/header":
            value = (self.headers.get("X-Test") or "").encode()
            self._send(value, ("Content-Length", str(len(value))))
        elif path == "/big":
            self._send(b"x" * 1_000_000, ("Content-Length", "1000000"))
        else:
            self._send(b"", ("Content-Length", "0"), status=404)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if self.headers.get("Transfer-Encoding") == "chunked":
            body = b""
            while (size := int(self.rfile.readline().split(b";")[0], 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(length)
        self._send(body[::-1], ("Content-Length", str(len(body))))

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "1234")  # of the body a GET would get: none follows
        self.end_headers()


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.handle_error = lambda request, address: None  # type: ignore[method-assign]  # clients that hang up
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with LoopbackClient(timeout=httpx.Timeout(2.0, connect=0.5)) as c:
        yield c


def test_keep_alive_reuses_one_connection(server: str, client: httpx.Client) -> None:
    first = client.get(f"{server}/length").content
    second = client.get(f"{server}/length").content
    chunked = client.get(f"{server}/chunked").content
    assert first.startswith(b"hello ") and first == second  # same client port: same connection
    assert chunked == b"hello " + first[6:]  # chunk extensions and trailers handled


def test_body_until_close_and_a_fresh_connection_after_it(server: str, client: httpx.Client) -> None:
    assert client.get(f"{server}/until-close").content == b"all of it"
    assert client.get(f"{server}/length").status_code == 200


def test_server_closing_an_idle_kept_alive_connection_is_retried_once(
    server: str, client: httpx.Client
) -> None:
    first = client.get(f"{server}/drop-after").content
    time.sleep(0.05)  # the server has closed it by now; the client still holds it
    second = client.get(f"{server}/drop-after").content
    assert first != second  # answered, on a new connection


def test_status_interim_head_and_request_bodies(server: str, client: httpx.Client) -> None:
    response = client.get(f"{server}/status")
    assert (response.status_code, response.content, response.reason_phrase) == (
        503,
        b"nope",
        "Service Unavailable",
    )
    assert client.get(f"{server}/interim").content == b"ok"  # a 103 before the answer is skipped
    head = client.head(f"{server}/length")
    assert head.headers["content-length"] == "1234" and head.content == b""
    assert client.post(f"{server}/echo", content=b"abc").content == b"cba"
    assert client.post(f"{server}/echo", content=iter([b"ab", b"cd"])).content == b"dcba"  # sent chunked
    assert client.get(f"{server}/length").status_code == 200  # the connection is still in step


def test_cookies_set_by_a_response_are_ignored(server: str, client: httpx.Client) -> None:
    assert client.get(f"{server}/length").headers["set-cookie"] == "a=b"
    assert not client.cookies


def test_read_timeout(server: str) -> None:
    with LoopbackClient(timeout=httpx.Timeout(0.1, connect=0.5)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.get(f"{server}/slow")
        time.sleep(0.5)
        assert client.get(f"{server}/length").status_code == 200  # a fresh connection afterwards


def test_connection_refused_is_a_connect_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
        with LoopbackClient() as client, pytest.raises(httpx.ConnectError):
            client.get(f"http://127.0.0.1:{port}/")


@pytest.mark.parametrize("path", ["/garbage", "/cut", "/bad-chunk"])
def test_malformed_or_cut_responses_are_protocol_errors(server: str, client: httpx.Client, path: str) -> None:
    with pytest.raises(httpx.RemoteProtocolError):
        client.get(f"{server}{path}")
    assert client.get(f"{server}/length").status_code == 200


def test_body_abandoned_midway_drops_the_connection(server: str, client: httpx.Client) -> None:
    port = client.get(f"{server}/length").content[6:]
    with client.stream("GET", f"{server}/big") as response:
        next(response.iter_bytes())  # read a little, then give up
    assert client.get(f"{server}/length").content[6:] != port  # not reused: it was out of step


def test_other_schemes_and_header_injection_are_refused(client: httpx.Client) -> None:
    with pytest.raises(httpx.UnsupportedProtocol):
        LoopbackTransport().handle_request(httpx.Request("GET", "https://127.0.0.1/"))
    with pytest.raises(httpx.LocalProtocolError):
        LoopbackTransport().handle_request(
            httpx.Request("GET", "http://127.0.0.1/", headers={"X": "a\r\nY: b"})
        )


def test_the_same_request_sent_again_goes_out_as_it_is_now(server: str, client: httpx.Client) -> None:
    request = client.build_request("GET", f"{server}/header", headers={"X-Test": "one"})
    assert [client.send(request).content for _ in range(2)] == [b"one", b"one"]
    request.headers["X-Test"] = "two"  # changed between two sends: the new header goes out
    assert client.send(request).content == b"two"
    request.url = httpx.URL(f"{server}/length")
    assert client.send(request).content.startswith(b"hello ")
