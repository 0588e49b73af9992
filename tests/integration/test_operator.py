"""The operator's faces end to end with the fake vLLM: `tunerd restart --set` and `tunerd status` as
subprocesses, the read-only TCP endpoint, the operator socket under malformed requests and its mode, and
the `--help` capability probe never taken for a foreign engine."""

from __future__ import annotations

import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from tests.harness import FAKE_VLLM, Daemon, Record, alive, running_daemon, wait_until
from tests.integration.conftest import fake_sections


def tunerd(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tunerd", *args, "--config", str(daemon.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def fence(daemon: Daemon, after: int) -> list[Record]:
    """Everything the daemon journaled after `after`, up to a marker it journals once it has handled what
    came before: a SIGHUP (same config: a reload that changes nothing) goes through the loop's event queue
    behind anything a request put there, and is journaled as `config.reloaded`."""
    daemon.signal(signal.SIGHUP)
    marker = daemon.wait_event("config.reloaded", after_seq=after)
    return [r for r in daemon.records() if after < r["seq"] < marker["seq"]]


def raw_unix_request(path: str, request: bytes) -> tuple[int, bytes]:
    """Send `request` as is over the unix socket at `path`, end the sending side, and return the status
    code of the answer and its whole text (the daemon closes the connection after one answer)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status_line = answer.split(b"\r\n", 1)[0]
    return int(status_line.split()[1]), answer


def test_restart_cli_with_set_restarts_the_engine_with_the_new_value(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        old_pid = daemon.wait_state("RUNNING")["engine"]["pid"]
        after = daemon.last_seq()
        asked = tunerd(daemon, "restart", "--set", "max_num_seqs=4")
        assert asked.returncode == 0, asked.stdout + asked.stderr
        intent = daemon.wait_record(
            lambda r: r["event"] == "intent" and r["action"] == "change", after_seq=after
        )
        assert intent["params"]["max_num_seqs"] == 4
        assert "max_num_seqs" not in intent["params_before"]
        spawned = daemon.wait_event("engine.spawned", after_seq=intent["seq"])
        assert spawned["argv"][spawned["argv"].index("--max-num-seqs") + 1] == "4"
        daemon.wait_record(
            lambda r: r["event"] == "outcome" and r["intent"] == intent["seq"] and r["result"] == "ok"
        )
        engine = daemon.wait_running(spawned["pid"])["engine"]
        assert engine["params"]["max_num_seqs"] == 4
        assert spawned["pid"] != old_pid
        assert not alive(old_pid)


def test_post_to_the_read_only_endpoint_is_405_and_changes_nothing(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        pid = daemon.wait_state("RUNNING")["engine"]["pid"]
        address = (daemon.state_dir / "export.addr").read_text().strip()
        after = daemon.last_seq()
        for command in ("restart", "resume"):
            answer = httpx.post(
                f"http://{address}/{command}",
                json={"params": {"max_num_seqs": 4}, "reason": "over TCP"},
                timeout=10,
                trust_env=False,
            )
            assert answer.status_code == 405, answer.text
            assert daemon.socket_path in answer.json()["error"], "the answer says where commands go"
        assert [r for r in fence(daemon, after) if r["event"] == "intent"] == []
        engine = daemon.status()["engine"]
        assert (engine["state"], engine["pid"]) == ("RUNNING", pid)
        assert "max_num_seqs" not in engine["params"]


def test_malformed_requests_on_the_operator_socket_get_400_and_the_daemon_keeps_serving(
    workdir: Path,
) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        pid = daemon.wait_state("RUNNING")["engine"]["pid"]
        after = daemon.last_seq()
        body = b'{"params": [1]}'
        requests = {
            "Content-Length not a number": b"POST /restart HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
            "negative Content-Length": b"POST /restart HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
            "params not an object": b"POST /restart HTTP/1.1\r\nContent-Length: %d\r\n\r\n%s"
            % (len(body), body),
            "body shorter than its Content-Length": b"POST /restart HTTP/1.1\r\nContent-Length: 10\r\n\r\n{}",
        }
        for what, request in requests.items():
            code, answer = raw_unix_request(daemon.socket_path, request)
            assert code == 400, f"{what}: {answer!r}"
        assert [r for r in fence(daemon, after) if r["event"] == "intent"] == []
        engine = daemon.status()["engine"]
        assert (engine["state"], engine["pid"]) == ("RUNNING", pid)
        assert daemon.command("resume").status_code == 202, "the socket still takes commands"


def test_operator_socket_is_a_socket_of_mode_0660(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        daemon.wait_state("RUNNING")
        mode = os.stat(daemon.socket_path).st_mode
        assert stat.S_ISSOCK(mode)
        assert stat.S_IMODE(mode) == 0o660


def descends_from(pid: int, ancestor: int) -> bool:
    try:
        return any(p.pid == ancestor for p in psutil.Process(pid).parents())
    except psutil.Error:
        return False


def test_first_start_does_not_report_its_own_help_probe_as_a_foreign_engine(workdir: Path) -> None:
    """The capability probe (`<engine command> --help`) looks like a vLLM server by its command line and
    carries no marker. Here the fake vLLM is started under vLLM's module name and its `--help` takes 15 s,
    as real vLLM's takes 10-20 s, so the probe is alive while the first preflight looks for foreign
    engines; a vLLM-looking process of the test's own shows that the look was taken and reports others,
    and the engine's port is held until the report is in (the report of a look still running when the
    preflight passes is not made). Another vLLM on the machine may be reported too: only the probe, or
    anything else of the daemon's, must not be."""
    engine_command = workdir / "vllm.entrypoints.openai.api_server"
    engine_command.symlink_to(FAKE_VLLM)
    sections = fake_sections(workdir, knobs={"FAKE_VLLM_HELP_S": "15"})
    sections["engine"]["command"] = [sys.executable, str(engine_command)]
    decoy = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "vllm.entrypoints.openai.api_server"],
        env={k: v for k, v in os.environ.items() if k != "TUNERD_INSTANCE"},
        start_new_session=True,
    )
    port_holder = socket.socket()
    port_holder.bind(("0.0.0.0", sections["engine"]["port"]))
    port_holder.listen()
    try:
        with running_daemon(workdir, sections) as daemon:
            assert daemon.proc is not None
            daemon_pid = daemon.proc.pid
            probes: list[int] = []

            def probe_seen() -> bool:
                probes[:] = [
                    p.pid
                    for p in psutil.process_iter()
                    if descends_from(p.pid, daemon_pid) and "--help" in _cmdline(p)
                ]
                return bool(probes)

            wait_until(probe_seen, 30, "the daemon's --help probe")
            reported = daemon.wait_event("preflight.foreign_engine", timeout=60)
            assert all(alive(pid) for pid in probes), (
                "the probe was still running when the look was journaled"
            )
            port_holder.close()
            pids = {p["pid"] for p in reported["processes"]}
            assert decoy.pid in pids, "the look for foreign engines was taken and reports a stranger"
            assert not pids & set(probes), f"its own --help probe {probes} was reported: {reported}"
            assert not [pid for pid in pids if descends_from(pid, daemon_pid)]
            first_spawn = daemon.wait_event("engine.spawned")
            foreign = [r for r in daemon.records() if r["event"] == "preflight.foreign_engine"]
            assert [r["seq"] for r in foreign if r["seq"] < first_spawn["seq"]] == [reported["seq"]]
            capabilities = daemon.wait_event("engine.capabilities", timeout=60)
            assert capabilities["shutdown_timeout"] is True and capabilities["error"] is None
            daemon.wait_state("RUNNING")
    finally:
        port_holder.close()
        decoy.kill()
        decoy.wait(10)


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_status_piped_into_head_exits_0_without_a_traceback(workdir: Path) -> None:
    with running_daemon(workdir, fake_sections(workdir)) as daemon:
        daemon.wait_state("RUNNING")
        status = (
            f"{shlex.quote(sys.executable)} -m tunerd status --config {shlex.quote(str(daemon.config_path))}"
        )
        # `head -1` as an operator types it; `true` reads nothing and is gone before tunerd writes, so
        # tunerd's write certainly meets a closed pipe (its short output fits the pipe's buffer, so with
        # head it may not). pipefail: tunerd's own exit status counts, not only the reader's.
        for reader in ("head -1", "true"):
            piped = subprocess.run(
                ["bash", "-c", f"set -o pipefail; {status} | {reader}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert piped.returncode == 0, f"| {reader}: {piped.returncode}\n{piped.stderr}"
            assert "Traceback" not in piped.stderr and "Error" not in piped.stderr, piped.stderr
            if reader == "head -1":
                assert piped.stdout.count("\n") == 1 and piped.stdout.strip(), piped.stdout
