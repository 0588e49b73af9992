"""The front door in-process, in front of the fake vLLM (tests/fake_vllm) as a subprocess, under a steady
load of concurrent clients (streaming and not), across the two ways vLLM goes away:

- a planned restart, driven as the daemon's loop will drive it: door draining → DoorDrained → SIGTERM to
  the fake, door down → a new fake on the same port → door serving: zero client failures, every answer
  complete;
- a SIGKILL of the fake's engine core (engine_killed_run2: in-flight requests get HTTP 500 or a stream
  error event, /health 503, then the API server exits): every non-streaming request completes (held or
  replayed), and the streams that were cut end with an error event and [DONE].

Every wait is for a condition; the only bounds are hang guards.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from prometheus_client import CollectorRegistry

from tests.harness import FAKE_VLLM, free_port
from tunerd.door import Door, DoorConfig, DoorDrained, DoorReleased

GUARD_S = 120.0
MAX_TOKENS = 25  # ~0.1 s per request at the fake's ~270 tokens/s


async def until(condition: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + GUARD_S
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
    return value


@dataclass
class Fake:
    proc: subprocess.Popen[bytes]
    url: str

    def engine_core(self) -> psutil.Process:
        return next(
            p for p in psutil.Process(self.proc.pid).children() if p.cmdline() == ["VLLM::EngineCore"]
        )


def start_fake(tmp_path: Path, port: int, n: int) -> Fake:
    """The fake as the supervisor starts vLLM: own session, output to a log file."""
    (tmp_path / "model").mkdir(exist_ok=True)
    argv = [sys.executable, str(FAKE_VLLM), "--model", str(tmp_path / "model"), "--port", str(port)]
    env = {**os.environ, "FAKE_VLLM_STARTUP_S": "0.5"}
    with open(tmp_path / f"vllm-{n}.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Fake(proc, f"http://127.0.0.1:{port}")


async def until_healthy(session: aiohttp.ClientSession, fake: Fake) -> None:
    """Poll the fake's /health (as the daemon's health job does) until it answers 200."""
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        try:
            async with session.get(f"{fake.url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"{fake.url} never served")


@dataclass
class Load:
    """`clients` closed-loop clients through the door; even-numbered ones stream."""

    url: str
    clients: int = 8
    ok: int = 0
    cut_streams: int = 0
    failures: list[str] = field(default_factory=list)
    stopping: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start(self, session: aiohttp.ClientSession) -> None:
        self.tasks = [asyncio.create_task(self._client(session, i)) for i in range(self.clients)]

    async def stop(self) -> None:
        self.stopping = True  # each client finishes the request it has in flight
        await asyncio.gather(*self.tasks)

    async def _client(self, session: aiohttp.ClientSession, i: int) -> None:
        stream = i % 2 == 0
        body = {"prompt": f"client {i} says the quick brown fox", "max_tokens": MAX_TOKENS, "stream": stream}
        while not self.stopping:
            try:
                async with session.post(f"{self.url}/v1/completions", json=body) as r:
                    status, data = r.status, await r.read()
            except aiohttp.ClientError as exc:
                self.failures.append(f"client {i}: {type(exc).__name__}: {exc}")
                continue
            verdict = judge(status, data, stream)
            if verdict == "ok":
                self.ok += 1
            elif verdict == "cut":
                self.cut_streams += 1
            else:
                self.failures.append(f"client {i}: {verdict}")


def judge(status: int, data: bytes, stream: bool) -> str:
    """ "ok" for a complete answer, "cut" for a stream that ended with an error event then [DONE]."""
    if status != 200:
        return f"HTTP {status}: {data[:200]!r}"
    if not stream:
        choice = json.loads(data)["choices"][0]
        complete = choice["text"] == "y" * MAX_TOKENS and choice["finish_reason"] == "length"
        return "ok" if complete else f"incomplete: {data[:200]!r}"
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    if events[-1:] != [b"[DONE]"]:
        return f"stream without [DONE]: {data[-200:]!r}"
    docs = [json.loads(e) for e in events[:-1]]
    if "error" in docs[-1]:
        return "cut" if len(docs) > 1 and all("error" not in d for d in docs[:-1]) else f"bad stream {data!r}"
    texts = "".join(d["choices"][0]["text"] for d in docs)
    complete = texts == "y" * MAX_TOKENS and docs[-1]["choices"][0]["finish_reason"] == "length"
    return "ok" if complete else f"incomplete stream: {data[-200:]!r}"


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.port = free_port()
        self.events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.seen: list[object] = []
        self.registry = CollectorRegistry()
        config = DoorConfig(port=0, hold_timeout_s=60.0, drain_timeout_s=30.0)
        self.door = Door(config, post=self.events.put, registry=self.registry)
        self.fakes: list[Fake] = []

    def new_fake(self) -> Fake:
        self.fakes.append(start_fake(self.tmp_path, self.port, len(self.fakes)))
        return self.fakes[-1]

    def event(self, kind: type) -> Any:
        while True:
            try:
                self.seen.append(self.events.get_nowait())
            except queue.Empty:
                break
        return next((e for e in self.seen if isinstance(e, kind)), None)

    def count(self, outcome: str) -> float:
        return self.registry.get_sample_value("tunerd_door_requests_total", {"outcome": outcome}) or 0.0

    @property
    def url(self) -> str:
        host, port = self.door.address
        return f"http://{host}:{port}"

    async def restart_fake(self, session: aiohttp.ClientSession, old: Fake) -> Fake:
        """What the daemon does once vLLM's tree is gone: start it again; serving once /health is 200."""
        await until(lambda: old.proc.poll() is not None, "the old fake gone")
        fake = self.new_fake()
        await until_healthy(session, fake)
        self.door.set_upstream(fake.url, "serving")
        return fake

    def close(self) -> None:
        self.door.stop()
        for fake in self.fakes:
            if fake.proc.poll() is None:
                os.killpg(fake.proc.pid, signal.SIGKILL)
                fake.proc.wait()


def run_with_door(tmp_path: Path, scenario: Callable[[Rig, aiohttp.ClientSession], Any]) -> Rig:
    rig = Rig(tmp_path)

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            fake = rig.new_fake()
            rig.door.start()  # down: the first requests wait until the fake serves
            await until_healthy(session, fake)
            rig.door.set_upstream(fake.url, "serving")
            await scenario(rig, session)

    try:
        asyncio.run(main())
    finally:
        rig.close()
    return rig


def test_planned_restart_under_load_loses_no_request(tmp_path: Path) -> None:
    async def scenario(rig: Rig, session: aiohttp.ClientSession) -> None:
        load = Load(rig.url)
        load.start(session)
        await until(lambda: load.ok >= 20, "load flowing")
        rig.door.set_upstream(None, "draining", "planned restart")
        drained = await until(lambda: rig.event(DoorDrained), "the drain's end")
        assert drained.ended == "idle" and drained.cut == 0
        old = rig.fakes[-1]
        rig.door.set_upstream(None, "down", "restarting")
        old.proc.send_signal(signal.SIGTERM)
        await rig.restart_fake(session, old)
        mark = load.ok
        await until(lambda: load.ok >= mark + 20, "load flowing again")
        await load.stop()
        assert load.failures == [] and load.cut_streams == 0
        released = rig.event(DoorReleased)
        assert released is not None and released.waiting > 0 and released.replays == 0
        assert rig.count("held") > 0 and rig.count("drain_cut") == 0 and rig.count("upstream_error") == 0

    run_with_door(tmp_path, scenario)


def test_engine_core_killed_under_load_every_plain_request_completes(tmp_path: Path) -> None:
    async def scenario(rig: Rig, session: aiohttp.ClientSession) -> None:
        load = Load(rig.url)
        load.start(session)
        await until(lambda: load.ok >= 20, "load flowing")
        old = rig.fakes[-1]
        old.engine_core().kill()  # SIGKILL: no drain possible
        await until(lambda: old.proc.poll() is not None, "the API server exits after its engine core")
        rig.door.set_upstream(None, "down", "engine_dead")  # what the loop does once it saw the failure
        await rig.restart_fake(session, old)
        mark = load.ok
        await until(lambda: load.ok >= mark + 20, "load flowing again")
        await load.stop()
        assert load.failures == []  # every plain request completed, every stream ended cleanly
        assert rig.count("replayed") >= 1
        assert rig.count("stream_cut") == load.cut_streams  # each cut stream got its error event and [DONE]

    run_with_door(tmp_path, scenario)
