"""Goodput on real vLLM (CPU build, the small model): under a closed loop of streaming clients whose
uncapped configuration misses a time-per-output-token target, the door's steered cap reaches a feasible
configuration without a restart, journals why, and the attainment tunerd counts agrees with what the
clients measured on their own clock.

The small model, not the tiny one: its engine bounds it (a decode step of ~20 ms on 2 cores, 250 tok/s),
so tokens reach the clients as vLLM makes them. With the tiny model 16 streams make ~3,000 events/s
and the API server, the door and the clients' threads fall behind and deliver whole answers in one burst
(a client's TPOT of 0 ms): a Python pipe's lag, not the batch's.

The target is set from this box, in this run: the clients' TPOT p90 with the cap pinned at 2, and their
TPOT p50 with no cap (vLLM runs up to max_num_seqs 32 at once) — the target is their geometric mean, so the
uncapped loop misses it on most requests and a small cap meets it on more than eight in ten. The box's
speed moves under the story (the other xdist worker starts vLLMs beside it): calibrated inside such a
minute, a target was ~1.7× too lax and the cap the story then read was no cap at all. So the pair is
measured twice and the quieter of each counts, and the geometric mean leaves the same factor of margin on
both sides, √(high/low). The small cap's TPOT is the one the box's load moves most: each token crosses
the API server, the door and a client thread, Python processes that share the other core with the other
worker's vLLM (with 24 at once, CI measured p90 81 ms at cap 2 and p50 138 ms with no cap, where a quiet
box gave 34 and 121: a margin of 1.3). 32 at once widens the gap the target is taken from. A box where
a batch of 32 decodes no slower than a batch of 2 cannot show this, and the test says so.

Then the concurrency curve through the cap (`tunerd door --curve`): the steered cap and no cap's equal,
30 s a point on the same start, scored by goodput: the steered cap wins (no cap misses the target), and the
cap is steered again after — no restart.

Agreement (stated): over the same requests (a load started and stopped between two reads of
tunerd_slo_requests_total and tunerd_slo_good_requests_total, read once they have counted every request
the clients finished), tunerd's attainment is within 0.10 of the clients'. The door stamps a request's
first and last bytes, the clients their reads of them (32 threads of one process on a busy box): a
request within a few per cent of the target can land on either side. Seen in CI: 94.0 % (clients) and
99.4 % (tunerd); 100.0 % and 100.0 %.
"""

from __future__ import annotations

import math
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import UP_S, real_sections
from tests.harness import Daemon, free_port, running_daemon, wait_until
from tests.integration.test_door_daemon import tunerd
from tests.load import ClosedLoopLoad

pytestmark = pytest.mark.engine

CLIENTS = 32  # the daemon's max_num_seqs: with no cap, vLLM decodes all of them at once (32 × 64 tokens
# at most: 2,048 of the 64 MB cache's ~3,900, so no preemption)
ATTAINMENT = 0.8
TTFT_S = 60.0  # generous: a closed loop waits in the door under a cap, and the door's wait counts in TTFT
TOLERANCE = 0.10


def pin(daemon: Daemon, cap: str) -> None:
    done = tunerd(daemon, "door", "--max-in-flight", cap)
    assert done.returncode == 0, done.stderr


def reload_config(daemon: Daemon, sections: dict[str, dict[str, Any]]) -> None:
    mark = daemon.last_seq()
    daemon.write_config(sections)
    daemon.signal(signal.SIGHUP)
    daemon.wait_event("config.reloaded", after_seq=mark, timeout=60)


def counted(daemon: Daemon) -> tuple[float, float]:
    """tunerd's counters: (requests judged, of them good)."""
    return (
        daemon.metric("tunerd_slo_requests_total") or 0.0,
        daemon.metric("tunerd_slo_good_requests_total") or 0.0,
    )


def door_limit(status: dict[str, Any]) -> dict[str, Any]:
    """The door's steered cap in a status document (`tunerd status`'s `door.limit`; {} when none)."""
    return (status.get("door") or {}).get("limit") or {}


def q(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * (len(ordered) - 1)))]


class Run:
    """One closed loop through the door from start to stop, with tunerd's counters read around it once
    they hold every request the clients finished."""

    def __init__(self, daemon: Daemon, url: str, model: str, seed: int) -> None:
        self.daemon = daemon
        self.load = ClosedLoopLoad(
            url, model, clients=CLIENTS, prompt_tokens=(16, 32), max_tokens=(24, 32), seed=seed, stream=True
        )
        self.before = counted(daemon)
        self.started = time.monotonic()
        self.seconds = 0.0
        self.kept: int | None = None  # the answers that are this run's (None: all; see `until`)

    def until(
        self, answers: int, timeout: float, what: str, release: Callable[[], None] | None = None
    ) -> Run:
        """Run the load until `answers` requests are answered, then stop it and wait for tunerd to count
        every request the clients finished. `release` (a calibration's): called once those answers are in,
        before the stop, to lift the cap — the stop waits for every client's request in flight, and at
        cap 2 the other 30 queued in the door took ~20 s to drain, two at a time. Then only the answers
        before the release are this run's (`rows`)."""
        self.load.start()
        wait_until(lambda: len(self.load.stats.streamed) >= answers, timeout, what)
        if release is not None:
            self.kept = len(self.load.stats.streamed)
            release()
        stats = self.load.stop(60)
        self.seconds = time.monotonic() - self.started
        assert stats.errors == [] and stats.stream_cut == 0, stats.errors[:5]
        finished = len(stats.streamed)
        wait_until(
            lambda: counted(self.daemon)[0] - self.before[0] >= finished,
            30,
            f"tunerd counting the {finished} requests the clients finished",
        )
        return self

    @property
    def rows(self) -> list[tuple[float, float, float | None]]:
        """(ended, TTFT, TPOT) of this run's answers, in the order they ended."""
        return self.load.stats.streamed[: self.kept]

    @property
    def tpots(self) -> list[float]:
        return [t for _, _, t in self.rows if t is not None]

    def clients_attainment(self, tpot_s: float) -> float:
        rows = self.rows
        good = sum(1 for _, ttft, tpot in rows if ttft <= TTFT_S and tpot is not None and tpot <= tpot_s)
        return good / len(rows)

    def tunerds_attainment(self) -> float:
        requests, good = counted(self.daemon)
        return (good - self.before[1]) / (requests - self.before[0])


def test_the_steered_cap_reaches_the_targets_without_a_restart_as_the_clients_measure_them(
    tmp_path: Path, small_model: Path, vllm_cache: dict[str, str], figures: Callable[[str], None]
) -> None:
    (tmp_path / "rules.toml").write_text("")  # no rule: only the door's cap moves
    original = real_sections(
        small_model,
        vllm_cache,
        engine__params={"max_num_seqs": CLIENTS, "kv_cache_memory_bytes": 64_000_000},
        observe={"poll_interval_s": 0.25, "window_s": 10.0},
        door={"enabled": True, "port": free_port(), "steer_interval_s": 2.0, "steer_min_samples": 8},
    )
    with running_daemon(tmp_path, original) as daemon:
        first = daemon.wait_state("RUNNING", timeout=UP_S)
        run_the_story(daemon, original, str(small_model), first, figures)


def run_the_story(
    daemon: Daemon,
    original: dict[str, dict[str, Any]],
    model: str,
    first: dict[str, Any],
    figures: Callable[[str], None],
) -> None:
    url = f"http://127.0.0.1:{daemon.sections['door']['port']}"
    # 1. This box's curve, on the clients' clock: a small cap, then none, twice. The quieter round of each
    # counts (the smaller TPOT): a vLLM start on the other worker slows every process on the box for a
    # minute, and a target calibrated inside it was ~1.7× too lax (CI: 111 ms where a quiet box gives
    # 64) — the configuration the clients then measured missing it, tunerd measured meeting it.
    smalls, uncappeds = [], []
    uncap = partial(pin, daemon, "none")
    for seed in (11, 21):
        pin(daemon, "2")
        smalls.append(Run(daemon, url, model, seed=seed).until(25, 300, "25 answers at cap 2", release=uncap))
        uncappeds.append(Run(daemon, url, model, seed=seed + 1).until(50, 300, "50 answers with no cap"))
    low = min(q(run.tpots, 0.9) for run in smalls)
    uncapped = min(uncappeds, key=lambda run: statistics.median(run.tpots))
    high = statistics.median(uncapped.tpots)
    assert high > 1.5 * low, (
        f"no batch effect to steer on this box: TPOT p90 {low * 1e3:.2f} ms at cap 2, "
        f"p50 {high * 1e3:.2f} ms with none"
    )
    target = math.sqrt(low * high)  # as far from each side, as a factor (the docstring)
    default_attainment = uncapped.clients_attainment(target)
    assert default_attainment < ATTAINMENT  # the uncapped configuration misses the target

    # 2. The objective, and the cap given back to the controller.
    mark = daemon.last_seq()
    sections = {name: dict(values) for name, values in original.items()}
    sections["objective"] = {
        "kind": "goodput",
        "ttft_s": TTFT_S,
        "tpot_s": round(target, 6),
        "attainment": ATTAINMENT,
    }
    reload_config(daemon, sections)
    steer = tunerd(daemon, "door", "--steer")
    assert steer.returncode == 0, steer.stderr
    steering = Run(daemon, url, model, seed=13)
    steering.load.start()
    found: dict[str, Any] = {}

    def feasible() -> bool:
        # Once the status window (observe.window_s, the document rebuilt every 0.5 s) holds only steered
        # requests: the calibration's last ones, judged again by the new target, read feasible before the
        # cap had moved (CI: "cap 24 when feasible").
        if time.monotonic() - steering.started <= original["observe"]["window_s"] + 1:
            return False
        status = daemon.status()
        found["cap"] = door_limit(status).get("limit")
        return status["objective"].get("feasible") is True

    try:
        wait_until(feasible, 600, "a feasible configuration")
    finally:
        steering.load.stop(60)
    reached_s = time.monotonic() - steering.started
    cap = found["cap"]

    # 3. The same requests on both clocks.
    measured = Run(daemon, url, model, seed=14).until(150, 600, "150 answers under the steered cap")
    clients, tunerds = measured.clients_attainment(target), measured.tunerds_attainment()
    shown = tunerd(daemon, "door").stdout

    records = [r for r in daemon.records() if r["seq"] > mark]
    limits = [r for r in records if r["event"] == "door.limit"]
    assert limits and any("upstream" in r["why"] for r in limits), limits  # why it moved, journaled
    assert not [r for r in records if r["event"] in ("trial.started", "engine.spawned")]
    assert daemon.status()["engine"]["pid"] == first["engine"]["pid"]  # no restart
    seen = (
        f"target {target * 1e3:.2f} ms, cap {cap} when feasible; over {len(measured.load.stats.streamed)} "
        f"requests: attainment {clients:.3f} (clients) {tunerds:.3f} (tunerd), clients' TPOT p50 "
        f"{statistics.median(measured.tpots) * 1e3:.2f} p90 {q(measured.tpots, 0.9) * 1e3:.2f} ms; "
        f"door: {shown}; door.limit records: {limits}"
    )
    assert cap is not None and 1 <= cap < CLIENTS, seen
    # Better than no cap on the clients' clock. Not "feasible" there too: the controller keeps probing one
    # above the knee (every memory_s) while these 150 answers come, and the target sits at the knee by
    # construction — CI's AVX2 box measured 0.693 against 0.70 (tunerd 0.676 over the same requests).
    assert clients >= default_attainment + TOLERANCE, seen
    assert abs(clients - tunerds) <= TOLERANCE, seen

    # 4. The concurrency curve through the cap (`tunerd door --curve`): the steered cap and no cap's
    # equal (max_num_seqs), measured in seconds per point on the same start, then the cap steered again.
    # The cap the controller holds now (it moved on since it was first feasible: CI's AVX2 box went from
    # 12 to 5), measured for 30 s a point: 15 s held too few fresh answers there (0 good/s at both points).
    cap = min(door_limit(daemon.status()).get("limit") or cap, CLIENTS - 1)
    curve = Run(daemon, url, model, seed=15)
    curve.load.start()
    try:
        measured_curve = subprocess.run(
            [sys.executable, "-m", "tunerd", "door", "--curve", f"{cap:.0f},{CLIENTS}", "--point-s", "30",
             "--settle-s", "3", "--config", str(daemon.config_path)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        curve.load.stop(60)
    assert measured_curve.returncode == 0, measured_curve.stdout + measured_curve.stderr
    (done,) = [r for r in daemon.records() if r["event"] == "door.curve.finished"]
    at_cap, at_all = done["points"]
    assert done["objective_name"] == "slo.goodput", done
    assert at_cap["objective"] > at_all["objective"] and at_all["attainment"] < ATTAINMENT, done
    assert done["best"] == cap, done
    wait_until(lambda: door_limit(daemon.status()).get("mode") == "steered", 30, "the cap steered again")
    assert daemon.status()["engine"]["pid"] == first["engine"]["pid"]  # still no restart
    figures(
        f"goodput on the small model, {CLIENTS} streaming clients, TPOT target {target * 1e3:.2f} ms "
        f"(clients' p90 {low * 1e3:.2f} ms at cap 2, p50 {high * 1e3:.2f} ms with none), "
        f"attainment ≥ {ATTAINMENT:.0%}:\n"
        f"  no cap: attainment {default_attainment:.1%} (clients), goodput "
        f"{default_attainment * len(uncapped.load.stats.streamed) / uncapped.seconds:.1f} req/s\n"
        f"  steered: feasible after {reached_s:.0f} s at cap {cap:.0f}, no restart; over "
        f"{len(measured.load.stats.streamed)} requests attainment {clients:.1%} (clients) vs "
        f"{tunerds:.1%} (tunerd), goodput "
        f"{clients * len(measured.load.stats.streamed) / measured.seconds:.1f} req/s (clients)\n"
        f"  $ tunerd door --curve {cap:.0f},{CLIENTS} --point-s 30 --settle-s 3\n{measured_curve.stdout}"
    )
