"""The faces in-process: the status document built from a Lifecycle, the read-only HTTP exporter on an
ephemeral port, and the operator socket (parsing, answers, a stalled client, its file mode)."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.unit.fakes import make_rig
from tunerd import __version__
from tunerd.core.commands import Command
from tunerd.core.states import EngineState
from tunerd.faces.http import Exporter
from tunerd.faces.operator import MAX_BODY, CommandError, OperatorSocket, parse_command
from tunerd.faces.status import DaemonFacts, build_status
from tunerd.records.metrics import Metrics

SOCKET_HINT = "/tmp/tunerd-hint.sock"


def short_socket_path() -> str:
    path = f"/tmp/tunerd-ut-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    assert len(path) < 100
    return path


# -- the status document --------------------------------------------------------------------------


def facts(journal: str, error: str | None = None) -> DaemonFacts:
    return DaemonFacts(
        pid=4242, uptime_s=99.96, config="/etc/tunerd/tunerd.toml", journal=journal, journal_error=error
    )


def test_the_status_of_a_running_engine_has_every_key_and_the_right_values(tmp_path: Path) -> None:
    rig = make_rig(tmp_path, {"engine": {"params": {"max_model_len": 4096}}})
    run = rig.serve()
    rig.step(12.3)
    doc = build_status(
        facts(str(rig.journal.path)),
        rig.lifecycle,
        run.params,
        {"kv_cache.usage": 0.25, "gpu.util_percent": None},
        {"kv_cache.usage": "ratio 0..1"},
        rig.recorder.last_record,
        rig.now,
    )
    assert doc["daemon"] == {
        "version": __version__,
        "pid": 4242,
        "uptime_s": 100.0,
        "config": "/etc/tunerd/tunerd.toml",
        "journal": str(rig.journal.path),
        "journal_error": None,
    }
    assert doc["engine"] == {
        "state": "RUNNING",
        "status": f"engine RUNNING (pid {run.pid})",
        "pid": run.pid,
        "uptime_s": 12.3,
        "params": {"max_model_len": 4096},
        "known_good": None,
        "known_good_verified": True,
        "kv_cache_tokens": 1952,
        "log": str(run.log_path),
        "consecutive_failures": 0,
        "fatal_reason": None,
        "waiting_reason": None,
        "next_start_in_s": None,
        "restarts": {},
        "notes": {},
        "identity": None,
        "memory_baseline": {
            "baseline_available_bytes": 60 << 30,
            "tolerance_bytes": 3 << 30,
            "baseline_gpu_free_bytes": None,
        },
    }
    assert doc["last_journal"]["event"] == "outcome" and doc["last_journal"]["result"] == "ok"
    assert doc["signals"] == {
        "kv_cache.usage": {"value": 0.25, "unit": "ratio 0..1"},
        "gpu.util_percent": {"value": None, "unit": ""},
    }
    assert json.loads(json.dumps(doc, default=str))["engine"]["pid"] == run.pid


def test_the_status_in_backoff_says_when_the_next_start_comes_and_why(tmp_path: Path) -> None:
    rig = make_rig(tmp_path)
    run = rig.serve()
    rig.os.kill(run.pid)
    rig.step()
    rig.settle()
    rig.step(3.0)
    doc = build_status(facts("j", "disk full"), rig.lifecycle, rig.lifecycle.params, {}, {}, None, rig.now)
    engine = doc["engine"]
    assert engine["state"] == "BACKOFF" and engine["status"] == "engine BACKOFF"
    assert engine["pid"] is None and engine["log"] is None and engine["uptime_s"] is None
    assert engine["next_start_in_s"] == 7.0
    assert engine["restarts"] == {"killed": 1}
    assert engine["consecutive_failures"] == 1
    assert doc["daemon"]["journal_error"] == "disk full"
    assert doc["last_journal"] is None and doc["signals"] == {}


# -- the HTTP exporter ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    metrics = Metrics()
    metrics.set_engine(EngineState.RUNNING)
    metrics.restarts.labels(reason="wedged").inc()
    face = Exporter("127.0.0.1", 0, metrics, SOCKET_HINT)
    face.start()
    try:
        yield face
    finally:
        face.stop()


@pytest.fixture(scope="module")
def http(exporter: Exporter) -> Iterator[httpx.Client]:
    host, port = exporter.address
    with httpx.Client(base_url=f"http://{host}:{port}", trust_env=False, timeout=5.0) as client:
        yield client


def test_the_exporter_listens_on_an_ephemeral_port_when_asked_for_port_0(exporter: Exporter) -> None:
    host, port = exporter.address
    assert host == "127.0.0.1" and port > 0


def test_get_metrics_serves_the_tunerd_families(http: httpx.Client) -> None:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert "tunerd_engine_state 20.0" in lines
    assert "tunerd_engine_up 1.0" in lines
    assert 'tunerd_engine_restarts_total{reason="wedged"} 1.0' in lines


def test_get_status_serves_the_document_last_published(exporter: Exporter, http: httpx.Client) -> None:
    exporter.publish({"engine": {"state": "STARTING"}})
    exporter.publish({"engine": {"state": "RUNNING", "pid": 7}})
    response = http.get("/status")
    assert response.status_code == 200
    assert response.json() == {"engine": {"state": "RUNNING", "pid": 7}}


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH"])
def test_a_command_sent_to_the_exporter_is_refused_naming_the_socket(http: httpx.Client, method: str) -> None:
    response = http.request(method, "/restart", content=b"{}")
    assert response.status_code == 405
    assert response.json() == {"error": f"read-only endpoint: commands go over the unix socket {SOCKET_HINT}"}


def test_an_unknown_path_is_404(http: httpx.Client) -> None:
    assert http.get("/nothing").status_code == 404


# -- parse_command ------------------------------------------------------------------------------------


def parse(name: str, length: str | None, body: bytes = b"") -> Command:
    return parse_command(name, length, io.BytesIO(body).read)


@pytest.mark.parametrize(
    ("name", "length", "body", "status", "message"),
    [
        (
            "reboot",
            "0",
            b"",
            404,
            "unknown command 'reboot' (known: cache-reset, curve, door, explore, pause, probe, restart, "
            "resume)",
        ),
        ("restart", "abc", b"", 400, "Content-Length 'abc' is not a byte count"),
        ("restart", "-1", b"", 400, "Content-Length '-1' is not a byte count"),
        ("restart", "+5", b"", 400, "Content-Length '+5' is not a byte count"),
        ("restart", str(MAX_BODY + 1), b"", 413, f"body of {MAX_BODY + 1} bytes is over {MAX_BODY}"),
        ("restart", "10", b"{}", 400, "body ended after 2 of 10 bytes"),
        ("restart", "5", b"nope!", 400, "the body is not JSON"),
        ("restart", "3", b"[1]", 400, "the body must be a JSON object"),
        ("restart", "15", b'{"params": [1]}', 400, '"params" must be an object'),
        ("restart", "24", b'{"params": {"a": [1]}}  ', 400, '"params" must be an object'),
        ("restart", "13", b'{"reason": 5}', 400, '"reason" must be a string'),
    ],
    ids=[
        "unknown",
        "abc",
        "negative",
        "signed",
        "too-large",
        "short-body",
        "not-json",
        "not-object",
        "params-list",
        "params-nested",
        "reason-number",
    ],
)
def test_parse_command_rejects_malformed_requests(
    name: str, length: str, body: bytes, status: int, message: str
) -> None:
    with pytest.raises(CommandError) as caught:
        parse(name, length, body)
    assert caught.value.status == status
    assert str(caught.value).startswith(message)


def test_parse_command_accepts_params_and_a_reason() -> None:
    body = json.dumps({"params": {"max_model_len": 2048, "enable_prefix_caching": False}, "reason": "trial"})
    command = parse("restart", str(len(body)), body.encode())
    assert command == Command("restart", {"max_model_len": 2048, "enable_prefix_caching": False}, "trial")


def test_parse_command_without_a_body_is_a_bare_command() -> None:
    assert parse("resume", None) == Command("resume", {}, None)


# -- the operator socket -------------------------------------------------------------------------------


class Inbox:
    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.refuse: str | None = None

    def accept(self, command: Command) -> str | None:
        if self.refuse is not None:
            return self.refuse
        self.commands.append(command)
        return None


@pytest.fixture(scope="module")
def operator() -> Iterator[tuple[OperatorSocket, Inbox]]:
    inbox = Inbox()
    face = OperatorSocket(short_socket_path(), inbox.accept)
    face.start()
    try:
        yield face, inbox
    finally:
        face.stop()


@pytest.fixture
def inbox(operator: tuple[OperatorSocket, Inbox]) -> Inbox:
    _face, box = operator
    box.commands.clear()
    box.refuse = None
    return box


@pytest.fixture
def client(operator: tuple[OperatorSocket, Inbox]) -> Iterator[httpx.Client]:
    transport = httpx.HTTPTransport(uds=operator[0].path)
    with httpx.Client(transport=transport, base_url="http://tunerd", timeout=5.0) as c:
        yield c


def test_a_good_command_is_answered_202_and_handed_to_accept(client: httpx.Client, inbox: Inbox) -> None:
    response = client.post("/restart", json={"params": {"max_model_len": 2048}, "reason": "trial"})
    assert response.status_code == 202 and response.json() == {"accepted": True}
    assert inbox.commands == [Command("restart", {"max_model_len": 2048}, "trial")]


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [("/restart", b"not json", 400), ("/restart", b'{"params": [1]}', 400), ("/reboot", b"{}", 404)],
    ids=["not-json", "params-list", "unknown"],
)
def test_a_malformed_command_is_refused_and_never_accepted(
    client: httpx.Client, inbox: Inbox, path: str, body: bytes, status: int
) -> None:
    response = client.post(path, content=body)
    assert response.status_code == status
    assert "error" in response.json()
    assert inbox.commands == []


def test_a_command_accept_refuses_is_answered_400_with_its_reason(client: httpx.Client, inbox: Inbox) -> None:
    inbox.refuse = "max_model_len: Input should be greater than 0"
    response = client.post("/restart", json={"params": {"max_model_len": 0}})
    assert response.status_code == 400
    assert response.json() == {"error": "max_model_len: Input should be greater than 0"}


def test_a_chunked_body_is_refused_with_411(operator: tuple[OperatorSocket, Inbox], inbox: Inbox) -> None:
    request = b"POST /resume HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(5.0)
        raw.connect(operator[0].path)
        raw.sendall(request)
        assert raw.recv(4096).startswith(b"HTTP/1.0 411")
    assert inbox.commands == []


def test_get_on_the_socket_is_405(client: httpx.Client) -> None:
    assert client.get("/restart").status_code == 405


def test_a_client_that_stalls_mid_body_does_not_block_the_others(
    operator: tuple[OperatorSocket, Inbox], client: httpx.Client, inbox: Inbox
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
        stalled.connect(operator[0].path)
        stalled.sendall(b"POST /restart HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
        response = client.post("/resume", json={"reason": "while another waits"})
        assert response.status_code == 202
        assert inbox.commands == [Command("resume", {}, "while another waits")]
        stalled.setblocking(False)
        with pytest.raises(BlockingIOError):
            stalled.recv(1)  # the first is still waiting for its body: no answer yet
        stalled.settimeout(5.0)
        stalled.shutdown(socket.SHUT_WR)  # it gives up sending: the short body is refused
        answer = b""
        while chunk := stalled.recv(4096):  # headers and body may come in two writes; then EOF
            answer += chunk
    assert answer.startswith(b"HTTP/1.0 400")
    assert b"body ended after 1 of 100 bytes" in answer
    assert inbox.commands == [Command("resume", {}, "while another waits")]


def test_the_socket_file_is_mode_0660(operator: tuple[OperatorSocket, Inbox]) -> None:
    mode = os.stat(operator[0].path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


def test_a_second_daemon_cannot_take_a_live_socket(operator: tuple[OperatorSocket, Inbox]) -> None:
    with pytest.raises(OSError, match="another tunerd answers on this socket"):
        OperatorSocket(operator[0].path, lambda _c: None)


def test_a_stale_socket_file_is_replaced_and_removed_at_stop() -> None:
    path = short_socket_path()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # a socket file nobody listens on: left by a daemon that died
    face = OperatorSocket(path, lambda _c: None)
    face.start()  # stop() without start() would wait forever in socketserver's shutdown()
    try:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
    finally:
        face.stop()
    assert not os.path.exists(path)
