"""The front door on real vLLM (CPU build, tiny model), in CI: no client request lost.

On the tiny daemon the engine tier shares (conftest.tiny_daemon, the door on); clients call the door's port
only, plain and streamed, without pause.
1. A tuning restart (a rule that holds under any load steps max_num_batched_tokens down: a trial, then
   its verdict, kept or reverted by a second restart; not max_num_seqs, which with the door on is first
   measured through the door's cap, without a restart) with the hold timeout above the measured restart
   time: zero client requests fail, every answer is whole, and the journal shows the drain, the
   restart and the release of the held requests.
2. The engine core killed under the same load: noticed from vLLM itself, the whole old tree reaped (the
   worker lingers ~2 s after the API server exits with 0), restarted; every plain request completes
   (held or replayed), and the streams that were cut end with an error event and [DONE] — never a hang
   or a reset. The kill comes while one long stream is mid-answer at vLLM: with the tiny model a 64-token
   answer takes ~0.3 s, and a closed loop's requests finish together, so "requests in flight at the door"
   can be answers already generated on their way back, with the engine core idle (a CI run killed it then:
   nothing was cut, and the clients' next requests simply waited in the door). The long stream's first
   token can itself come after vLLM generated all of it: the kill waits until the stream is seen open with
   the core stopped, and otherwise tries a new long stream.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.engine.conftest import UP_S, reload_rules
from tests.harness import Daemon, alive, wait_until
from tests.load import ClosedLoopLoad
from tunerd.procfs import processes as procfs

pytestmark = pytest.mark.engine

ALWAYS = """
[[rule]]
name = "always"
why = "the test's trial: holds under any load"
all = ["requests.running_avg > 0"]
for_s = 5
cooldown_s = 3600
action = { kind = "step", param = "max_num_batched_tokens", direction = "down", factor = 0.5 }
"""


def answered(*loads: ClosedLoopLoad) -> int:
    return sum(load.stats.ok for load in loads)


def all_answered_since(t: float, *loads: ClosedLoopLoad) -> bool:
    """Every client of `loads` had a whole answer after `t` (time.monotonic()): none has a request from
    before `t` in flight."""
    return all(sum(1 for at in load.stats.last_ok_at.values() if at > t) == load.clients for load in loads)


def events_after(daemon: Daemon, seq: int) -> list[dict[str, Any]]:
    return [r for r in daemon.records() if r["seq"] > seq]


def long_stream(url: str, model: str, first_token: threading.Event) -> dict[str, Any]:
    """One streamed request of 480 tokens (`ignore_eos`; the tiny model's max_model_len is 512) through
    the door; `first_token` is set at its first token event. Returns what it ended with: token events,
    an error event, [DONE]."""
    body = {"model": model, "prompt": [11] * 16, "max_tokens": 480, "ignore_eos": True, "stream": True}
    seen: dict[str, Any] = {"tokens": 0, "error": False, "done": False}
    with (
        httpx.Client(timeout=600, trust_env=False) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as answer,
    ):
        for line in answer.iter_lines():
            if line == "data: [DONE]":
                seen["done"] = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                seen["error"] |= "error" in event
                seen["tokens"] += len(event.get("choices", ()))
                if seen["tokens"]:
                    first_token.set()
    first_token.set()  # ended without a token: the waiter reads the outcome, not a timeout
    return seen


class LongStream:
    """One `long_stream` through the door, sent when `start` is called (mid_answer sends it with vLLM's
    engine core stopped); `first_token` is set at its first token event."""

    def __init__(self, pool: ThreadPoolExecutor, url: str, model: str) -> None:
        self.first_token = threading.Event()
        self._send = partial(pool.submit, long_stream, url, model, self.first_token)
        self.future: Future[dict[str, Any]] | None = None

    def start(self) -> Future[dict[str, Any]]:
        self.future = self._send()
        return self.future

    def result(self) -> dict[str, Any]:
        assert self.future is not None, "the long stream was never sent"
        return self.future.result(timeout=300)


def test_no_client_request_is_lost_across_a_tuning_restart_or_an_engine_crash(
    tiny_daemon: Daemon, tiny_model: Path, figures: Callable[[str], None]
) -> None:
    daemon = tiny_daemon
    if not daemon.running:
        daemon.start()
    first = daemon.wait_state("RUNNING", timeout=UP_S)
    mark = daemon.last_seq()
    reload_rules(daemon, ALWAYS)
    try:
        url = f"http://127.0.0.1:{daemon.sections['door']['port']}"
        plain = ClosedLoopLoad(url, str(tiny_model), clients=3, max_tokens=64, seed=1)
        streams = ClosedLoopLoad(url, str(tiny_model), clients=2, max_tokens=64, seed=2, stream=True)
        with plain, streams:
            # 1. The trial's restart (and the verdict's, when it reverts) under load.
            started = daemon.wait_event("trial.started", after_seq=mark, timeout=UP_S)
            decided = daemon.wait_event("trial.decided", after_seq=started["seq"], timeout=UP_S)
            if decided["decision"] == "reverted":
                daemon.wait_event("trial.ended", after_seq=decided["seq"], timeout=UP_S)
            daemon.wait_state("RUNNING", timeout=UP_S)
            before = answered(plain, streams)
            wait_until(lambda: answered(plain, streams) >= before + 10, 300, "answers after the restarts")
            restarted = events_after(daemon, started["seq"] - 1)
            assert plain.stats.errors == [] and streams.stats.errors == [], (
                plain.stats.errors[:5],
                streams.stats.errors[:5],
            )
            assert streams.stats.stream_cut == 0  # a planned restart drains: no stream is cut
            drained = [r for r in restarted if r["event"] == "door.drained"]
            released = [r for r in restarted if r["event"] == "door.released"]
            stopped = [r for r in restarted if r["event"] == "engine.stopped"]
            assert drained and all(d["cut"] == 0 for d in drained), drained
            assert stopped and all(s["seq"] > drained[0]["seq"] for s in stopped)
            assert released and sum(r["waiting"] for r in released) >= 1  # clients were held, then let go

            # 2. The engine core killed under the same load, with a long stream mid-answer at vLLM: the core
            # stopped before the stream is sent, throttled until the client has its first token, then left
            # stopped until what the API server already holds has reached the client (mid_answer). Killed
            # only when the stream is still open then: unthrottled, the client's first token came after vLLM
            # had generated all 480 (CI: its API server seconds behind the engine core on the busy box; on an
            # AVX-512 box all 480 in ~0.7 s, before the throttle began) and the kill cut nothing. A stream
            # made whole before its first token reached the client is a miss without a kill; another
            # long stream is tried (at most two kills: the daemon's max_failures is 3). Each try waits
            # until every client has been answered since the last: a request a kill cut was replayed once,
            # and cut again it is not sent a third time (the door's "exactly once": fresh-clone run 27's
            # second kill came 0.25 s after the first retry served, and 3 replays got HTTP 500).
            cut: dict[str, Any] = {}
            kills, tries = 0, []
            for attempt in range(4):
                if attempt:
                    since = partial(all_answered_since, time.monotonic(), plain, streams)
                    wait_until(since, 300, "every client answered since the last try (no replay in flight)")
                with ThreadPoolExecutor(1) as pool:
                    long = LongStream(pool, url, str(tiny_model))
                    killed = killed_core(daemon, mid_answer=partial(mid_answer, long))
                    cut = long.result()
                kills += killed
                tries.append({"killed": killed, **cut})
                if (killed and (cut["error"] or cut["tokens"] < 480)) or kills == 2:
                    break
            assert cut["error"] and cut["done"] and 0 < cut["tokens"] < 480, tries  # cut, ended cleanly
            before = answered(plain, streams)
            wait_until(lambda: answered(plain, streams) >= before + 10, 300, "answers after the crash")
    finally:
        reload_rules(daemon, None)
    assert plain.stats.errors == [], plain.stats.errors[:5]  # held or replayed: none lost
    assert streams.stats.errors == [], streams.stats.errors[:5]  # cut ones ended cleanly
    replayed = daemon.metric("tunerd_door_requests_total", outcome="replayed") or 0
    assert first["engine"]["pid"] != daemon.status()["engine"]["pid"]
    figures(
        f"through the door: {plain.stats.ok} plain and {streams.stats.ok} streamed answers whole, "
        f"{replayed:.0f} cut before any byte and replayed, {streams.stats.stream_cut} streams cut by "
        f"the crash ended with an error event; 0 failed; the long stream cut after {cut['tokens']} tokens "
        f"(try {len(tries)})"
    )


# The engine core runs this long at a time while the long stream waits for its first token, stopped
# (SIGSTOP) between slices while the API server hands on what it made. Unthrottled, CI's API server ran
# seconds behind the core, and all 480 tokens were made before the client saw the first: the kill cut
# nothing (fresh-clone runs 18 and 21, twice in a row in 21). Throttled, a slice makes a few tokens; but
# the API server can still hold a whole answer when the first token arrives (run 27; here too, once): so
# once it has, the core stays stopped for FLUSH_S, and a stream that ended meanwhile was whole before the
# kill could cut it.
SLICE_S, CATCH_UP_S, FLUSH_S = 0.05, 0.5, 3.0


def mid_answer(stream: LongStream, core: int) -> bool:
    """Sends the long stream with vLLM's engine core `core` stopped (SIGSTOP), and says whether it has its
    first token and is still open `FLUSH_S` after it, the core stopped all along (a SIGKILL ends it all the
    same): what it waits for is the core's to make. The core runs `SLICE_S` at a time until the first
    token, stopped for up to `CATCH_UP_S` between slices. False, with the core running again, when the
    stream ended (made whole before the client saw its first token) or no token came within 120 s.

    Stopped before the stream is sent: fresh-clone run 33 (an AVX-512 box) failed with every try whole.
    Run alone here with the stream sent first, as before, the first stop came 1.5-2.4 s after it (after
    killed_core's look-ups, which read the journal whole), and the client had all 480 tokens 0.9-1.9 s
    after sending: four tries of one run and two of each of two others were whole that way."""
    os.kill(core, signal.SIGSTOP)
    long, first_token = stream.start(), stream.first_token
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        os.kill(core, signal.SIGSTOP)
        if first_token.wait(CATCH_UP_S):
            wait([long], timeout=FLUSH_S)  # the API server hands on what it holds; the core makes nothing
            if not long.done():
                return True
            break
        os.kill(core, signal.SIGCONT)
        first_token.wait(SLICE_S)  # the core's slice: over early once the token is there
    os.kill(core, signal.SIGCONT)
    return False


def killed_core(daemon: Daemon, mid_answer: Callable[[int], bool]) -> bool:
    """SIGKILL vLLM's engine core once `mid_answer(core)` (a wait) says a request is being generated: noticed
    from vLLM itself (its EngineDeadError lines, or its API server's exit with 0), not from failed health
    checks (how fast: bench/detection_latency.py --scenario engine-kill); every process of the old tree
    reaped, the worker included; a retry that serves. The processes are looked up before the wait, so
    that the kill follows it within a system call. False, and nothing killed, when `mid_answer(core)`
    says no request is mid-answer."""
    old_tree = daemon.marked_pids()
    core = next(pid for pid in old_tree if getattr(procfs.read_stat(pid), "comm", "") == "VLLM::EngineCor")
    api_server = daemon.status()["engine"]["pid"]
    after = daemon.last_seq()
    if not mid_answer(core):
        return False
    os.kill(core, signal.SIGKILL)
    failed = daemon.wait_event("engine.failed", timeout=120, after_seq=after)
    assert failed["failure"]["kind"] in ("engine_dead", "exited")
    assert failed["pid"] == api_server and failed["phase"] == "running"
    stopped = daemon.wait_event("engine.stopped", timeout=60, after_seq=after)
    assert stopped["survivors"] == []
    assert not [pid for pid in old_tree if alive(pid)], "no process of the old tree survives"
    retry = daemon.wait_record(lambda r: r["event"] == "intent" and r["action"] == "retry", after_seq=after)
    daemon.wait_record(
        lambda r: r["event"] == "outcome" and r["intent"] == retry["seq"] and r["result"] == "ok",
        timeout=UP_S,
    )
    new_tree = daemon.marked_pids()
    assert new_tree and not set(new_tree) & set(old_tree)
    return True
