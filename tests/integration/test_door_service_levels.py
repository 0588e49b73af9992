"""The door's per-request figures in the real daemon, in front of the fake vLLM, against the test's own
clients: the door's client-side TTFT and TPOT agree with what the clients measured on their own clock,
and attainment drops — on TPOT, not TTFT — once the fake decodes slower than the target.

Tolerance (stated): TTFT percentiles within 30 ms + 20 %, TPOT percentiles within 2 ms + 20 %. The door
stamps a request's arrival and its first and last bytes; the client stamps its send and its reads, so
the client's figures are the door's plus loopback and thread wake-up time (milliseconds on a busy 2-core
box), and TPOT's (last − first)/(tokens − 1) divides that jitter by the token count.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from tests.harness import Daemon, running_daemon, wait_until
from tests.integration.test_door_daemon import door_sections, door_url
from tests.integration.test_observe import control

TOKENS = 40


def quantile(values: list[float], q: float) -> float:
    """Linear between closest ranks: the door's own definition (core/slo.quantile)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


class Clients:
    """`clients` threads, each sending `each` streamed completions (usage included) one after another,
    timing each on the test's clock: TTFT = send → first token event, TPOT = (last − first token event)
    / (tokens − 1)."""

    def __init__(self, url: str, clients: int, each: int) -> None:
        self.url, self.clients, self.each = f"{url}/v1/completions", clients, each
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()

    def run(self) -> None:
        threads = [threading.Thread(target=self._client) for _ in range(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _client(self) -> None:
        body = {
            "model": "model",
            "prompt": "the quick brown fox",
            "max_tokens": TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        with httpx.Client(timeout=120, trust_env=False) as client:
            for _ in range(self.each):
                sent = time.monotonic()
                times: list[float] = []
                with client.stream("POST", self.url, json=body) as answer:
                    for line in answer.iter_lines():
                        if line.startswith("data: {"):
                            event = json.loads(line[6:])
                            if any(c.get("text") for c in event.get("choices", ())):
                                times.append(time.monotonic())
                with self.lock:
                    if answer.status_code != 200 or len(times) != TOKENS:
                        self.errors.append(f"HTTP {answer.status_code}, {len(times)} tokens")
                        continue
                    self.ttft.append(times[0] - sent)
                    self.tpot.append((times[-1] - times[0]) / (len(times) - 1))


def objective(daemon: Daemon) -> dict[str, Any]:
    return daemon.status().get("objective") or {}


def window(daemon: Daemon) -> dict[str, Any]:
    return objective(daemon).get("window") or {}


def close(door: float | None, client: float, absolute: float) -> bool:
    return door is not None and abs(door - client) <= absolute + 0.2 * client


def test_the_doors_ttft_and_tpot_agree_with_the_clients_and_attainment_drops_when_vllm_slows(
    workdir: Path,
) -> None:
    ctl = workdir / "control.json"
    control(ctl)
    sections = door_sections(workdir)
    sections["engine.env"]["FAKE_VLLM_CONTROL"] = str(ctl)
    sections["observe"] = {"poll_interval_s": 0.5, "window_s": 300.0}  # holds every request of the test
    sections["objective"] = {"ttft_s": 1.0, "tpot_s": 0.02}  # the fake: ~3.7 ms per token, TTFT ~20 ms
    sections["tuning"] = {"mode": "off"}
    with running_daemon(workdir, sections) as daemon:
        daemon.wait_state("RUNNING")
        fast = Clients(door_url(sections), clients=4, each=10)
        fast.run()
        assert fast.errors == [], fast.errors[:5]
        wait_until(lambda: window(daemon).get("slo.requests") == 40.0, 30, "the door's 40 samples")
        w = window(daemon)
        for name, client, absolute in (
            ("door.ttft.p50", quantile(fast.ttft, 0.5), 0.030),
            ("door.tpot.p50", quantile(fast.tpot, 0.5), 0.002),
        ):
            assert close(w[name], client, absolute), (name, w[name], client)
        # A p95 of 40 is their second largest: one client thread descheduled on a busy box (CI, stop 28:
        # 0.32 s on the clients' clock, 0.14 s at the door) moves the clients' one alone. The door's sits
        # between the clients' median and their p95, the clients' clock holding the door's.
        for metric, samples, absolute in (("ttft", fast.ttft, 0.030), ("tpot", fast.tpot, 0.002)):
            low, high = quantile(samples, 0.5) - absolute, quantile(samples, 0.95) + absolute
            assert low <= w[f"door.{metric}.p95"] <= high, (metric, w[f"door.{metric}.p95"], low, high)
        assert w["slo.attainment"] == 1.0 and objective(daemon)["feasible"] is True
        assert objective(daemon)["in_force"] == "goodput"
        assert daemon.metric("tunerd_slo_attainment_ratio") == 1.0

        control(ctl, request_tokens_per_s=25)  # 40 ms per token: over the 20 ms target
        slow = Clients(door_url(sections), clients=4, each=2)
        slow.run()
        assert slow.errors == [], slow.errors[:5]
        assert min(slow.tpot) > 0.02  # the clients felt it too
        wait_until(lambda: window(daemon).get("slo.requests") == 48.0, 30, "the door's 48 samples")
        w = window(daemon)
        assert w["slo.attainment"] == 40 / 48 and w["slo.attainment.tpot"] == 40 / 48
        assert w["slo.attainment.ttft"] == 1.0  # the first token still comes in time
        assert objective(daemon)["feasible"] is False  # 83 % < 95 %
        assert daemon.metric("tunerd_slo_target_attainment_ratio", target="tpot") == 40 / 48
        shown = daemon.status()["signals"]
        assert shown["requests.waiting"]["value"] == 0.0 and shown["door.waiting"]["value"] == 0.0
