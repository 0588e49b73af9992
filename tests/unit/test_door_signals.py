"""The door's figures as signals, in the real main loop's poll (supervisor.py `_on_poll`): requests waiting
in the door and requests waiting in vLLM are two signals (issue 21: `kv-cache-room-while-waiting` fired on
`requests.waiting_max` 112–120, the door's queue, with the KV cache 23–40 % full); the door's per-request
samples become `slo.*` and `door.*` signals and the tunerd_slo_* metrics; `tunerd status` shows them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.unit.fakes import FakeOsCalls, make_config, write_meminfo
from tunerd.cli.status import render_status
from tunerd.config.rules import StepAction, load_rules, parse_term
from tunerd.core.engine_sample import EngineSample
from tunerd.core.slo import RequestSample
from tunerd.door import DoorRequests, DrainState
from tunerd.faces.systemd import Notifier
from tunerd.observe.gpu import GpuSample
from tunerd.observe.poller import PollSample
from tunerd.observe.vllm_metrics import ScrapeResult
from tunerd.policy.evidence import Point, window_stats
from tunerd.policy.rules import RuleState, evaluate, term_value
from tunerd.records.state import DaemonState, StateStore
from tunerd.supervisor import Supervisor

RUN = 7
PLAYBOOK = Path(__file__).resolve().parents[2] / "etc" / "tunerd" / "rules.toml"
# vLLM's limits: raising them lets more of vLLM's own queue in; they cannot relieve the door's queue.
VLLM_LIMITS = {"max_num_seqs", "max_num_batched_tokens"}


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    proc = tmp_path / "proc"
    write_meminfo(proc, 60)
    socket_path = f"/tmp/tunerd-slo-{os.getpid()}-{uuid.uuid4().hex[:8]}.sock"
    overrides = {
        "paths": {"socket": socket_path},
        "export": {"enabled": False},
        "door": {"enabled": True, "port": 0},
        "objective": {"ttft_s": 1.0, "tpot_s": 0.05},
    }
    config = make_config(tmp_path, proc, overrides)
    caps = {"command": list(config.engine.command), "shutdown_timeout": False}
    StateStore(config.paths.state_file).save(DaemonState(capabilities=caps))
    sup = Supervisor(
        config, str(tmp_path / "tunerd.toml"), oscalls=FakeOsCalls(str(proc)), notifier=Notifier({})
    )
    sup.setup()
    try:
        yield sup
    finally:
        assert sup.door_link is not None and sup.operator is not None
        sup.door_link.door.stop()
        sup.operator.stop()
        sup.journal.close()


def poll(
    sup: Supervisor, now: float, waiting_in_vllm: float, queued_in_door: int, preemptions: float | None = None
) -> list[Any]:
    """Feed one poll of a serving run through `_on_poll`; return what the tuner was handed."""
    assert sup.lifecycle is not None and sup.tuner is not None and sup.door_link is not None
    sup.lifecycle.engine.run = SimpleNamespace(run_id=RUN)  # type: ignore[assignment]
    sup.lifecycle.on_poll = lambda sample, now: None  # type: ignore[method-assign]
    handed: list[Any] = []
    sup.tuner.on_poll = lambda sample, signals, now: handed.append(sample)  # type: ignore[method-assign]
    door = sup.door_link.door
    door.drain_state = lambda: DrainState("serving", 16, queued_in_door, 16)  # type: ignore[method-assign]
    engine = EngineSample(
        requests_running=16.0,
        requests_waiting=waiting_in_vllm,
        kv_cache_usage=0.3,
        preemptions_total=preemptions,
    )
    sample = PollSample(
        RUN, now, ScrapeResult(engine, None, 0.01, 100), None, GpuSample(False, "no NVML", now), {}
    )
    sup._on_poll(sample, now)
    return handed


def request(done: float, ttft: float, tpot: float | None, ok: bool = True) -> RequestSample:
    return RequestSample(done, 0.0, ttft, ttft, 100, True, tpot, ttft + 2.0, True, ok)


def test_requests_waiting_in_the_door_are_not_requests_waiting_in_vllm(supervisor: Supervisor) -> None:
    now = supervisor.monotonic()
    (handed,) = poll(supervisor, now, waiting_in_vllm=0.0, queued_in_door=112)
    signals = supervisor.signals
    assert signals["requests.waiting"] == 0.0 and signals["requests.waiting_max"] == 0.0  # vLLM's queue
    assert signals["door.waiting"] == 112.0 and signals["door.waiting_max"] == 112.0
    # The trial's windows get the same inputs: vLLM's sample untouched, the door's queue by name.
    assert handed.scrape.sample.requests_waiting == 0.0 and handed.readings["door.waiting"] == 112.0
    # So the shipped rule's term on vLLM's queue does not hold on a queue the door's cap holds...
    assert term_value(parse_term("requests.waiting_max > 0"), signals, {}, False, 0.0).holds is False
    assert term_value(parse_term("door.waiting_max > 100"), signals, {}, False, 0.0).holds is True
    # ...while a trial's offered load still counts both (saturation, outstanding requests).
    engine = handed.scrape.sample
    points = [
        Point(now + i, replace(engine, generation_tokens_total=100.0 * i), handed.readings) for i in range(3)
    ]
    stats = window_stats(points, now, now + 2, max_num_seqs=None, saturated_waiting=0.5)
    assert stats is not None and stats.waiting_avg == 112.0 and stats.saturated
    assert stats.waiting_max == 0.0


def test_the_shipped_rule_does_not_raise_max_num_seqs_for_a_queue_the_doors_cap_holds(
    supervisor: Supervisor,
) -> None:
    # Issue 21: with the cap at 16 or below, kv-cache-room-while-waiting fired four times on
    # requests.waiting_max 112-120 - the door's queue - with the KV cache 23-40 % full, and doubled
    # max_num_seqs by a restart. Here the door holds 100, vLLM none, the KV cache 30 % full, no preemption:
    # every poll through the real `_on_poll`, the rule evaluated on the live signals as the tuner does.
    (rule,) = [r for r in load_rules(str(PLAYBOOK)).rules if r.name == "kv-cache-room-while-waiting"]
    start = supervisor.monotonic()
    state, fired = RuleState(), []
    for i in range(int((rule.for_s + 120) / 5)):
        now = start + 5.0 * i
        poll(supervisor, now, waiting_in_vllm=0.0, queued_in_door=100, preemptions=0.0)
        result = evaluate(rule, state, supervisor.signals, {}, now)
        state, fired = result.state, [*fired, result.fired]
    assert supervisor.signals["door.waiting_max"] == 100.0 and supervisor.signals["preemptions.rate"] == 0.0
    assert result.holds is False and not any(fired)
    # The same queue in vLLM itself (the batch limit holding it back) does fire it: the rule still works.
    start = now
    for i in range(1, int((rule.for_s + 120) / 5)):
        now = start + 5.0 * i
        poll(supervisor, now, waiting_in_vllm=100.0, queued_in_door=0, preemptions=0.0)
        result = evaluate(rule, state, supervisor.signals, {}, now)
        state, fired = result.state, [*fired, result.fired]
    assert any(fired)


def test_no_shipped_rule_that_raises_vllms_limits_reads_the_doors_queue() -> None:
    # Raising max_num_seqs or max_num_batched_tokens can only relieve vLLM's own queue (requests.waiting*).
    raising = []
    for rule in load_rules(str(PLAYBOOK)).rules:
        action = rule.action
        up = isinstance(action, StepAction) and action.direction == "up"
        if up and VLLM_LIMITS & {action.param, *action.then}:  # type: ignore[union-attr]
            raising.append(rule.name)
            waits = [t.signal for t in rule.terms if "waiting" in t.signal]
            assert all(w.startswith("requests.waiting") for w in waits), (rule.name, waits)
    assert "kv-cache-room-while-waiting" in raising


def test_the_doors_requests_become_attainment_goodput_and_client_percentiles(supervisor: Supervisor) -> None:
    now = supervisor.monotonic() + 10.0
    supervisor._handle(
        DoorRequests(
            (
                request(now - 5, ttft=0.5, tpot=0.02),  # good
                request(now - 4, ttft=1.5, tpot=0.02),  # TTFT missed
                request(now - 3, ttft=0.4, tpot=0.09),  # TPOT missed
                request(now - 2, ttft=0.3, tpot=0.01),  # good
            )
        )
    )
    poll(supervisor, now, waiting_in_vllm=0.0, queued_in_door=0)
    s = supervisor.signals
    assert s["slo.attainment"] == pytest.approx(0.5)
    assert (s["slo.attainment.ttft"], s["slo.attainment.tpot"]) == (pytest.approx(0.75), pytest.approx(0.75))
    assert s["slo.attainment.e2e"] is None  # no e2e target
    assert s["slo.goodput"] == pytest.approx(2 / 10.0, rel=0.05)  # the window: observed ~10 s so far
    assert s["slo.requests"] == 4.0 and s["door.ttft.p95"] is not None and s["door.tpot.p95"] is not None
    registry = supervisor.metrics.registry
    assert registry.get_sample_value("tunerd_slo_attainment_ratio") == pytest.approx(0.5)
    assert registry.get_sample_value("tunerd_slo_target_attainment_ratio", {"target": "ttft"}) == 0.75
    assert registry.get_sample_value("tunerd_slo_target_seconds", {"target": "tpot"}) == 0.05
    assert registry.get_sample_value("tunerd_slo_goodput") == pytest.approx(s["slo.goodput"])
    assert registry.get_sample_value("tunerd_slo_attainment_objective_ratio") == 0.95
    counted = ("tunerd_slo_requests_total", "tunerd_slo_good_requests_total")
    assert [registry.get_sample_value(name) for name in counted] == [4.0, 2.0]

    assert supervisor.lifecycle is not None
    supervisor.lifecycle.engine.run = None  # the status of a daemon between runs: the window stays
    doc = supervisor._status(now)
    objective = doc["objective"]
    assert (objective["kind"], objective["in_force"], objective["feasible"]) == ("goodput", "goodput", False)
    assert objective["trials_compare"] == "slo.goodput"  # trials judge by the objective in force
    assert objective["window"]["slo.attainment"] == pytest.approx(0.5)
    page = render_status(doc)
    assert "objective: goodput; targets ttft ≤ 1 s, tpot ≤ 50 ms, attainment ≥ 95%" in page
    goodput = objective["window"]["slo.goodput"]
    assert goodput == pytest.approx(0.2, rel=0.05)
    assert f"attainment 50.0% (NOT feasible), goodput {goodput:.4g} req/s" in page
    assert "per target: ttft 75.0%, tpot 75.0%" in page
    supervisor._handle(DoorRequests((request(now + 0.5, ttft=0.1, tpot=0.01),)))
    poll(supervisor, now + 1, waiting_in_vllm=0.0, queued_in_door=0)  # the next poll: counted once more
    poll(supervisor, now + 2, waiting_in_vllm=0.0, queued_in_door=0)
    assert [registry.get_sample_value(name) for name in counted] == [5.0, 3.0]


def test_status_says_why_throughput_is_in_force_without_targets() -> None:
    doc = {
        "objective": {
            "kind": "goodput",
            "in_force": "throughput",
            "why": "goodput has no targets ([objective] ttft_s, tpot_s, e2e_s): throughput is in force",
            "targets": {"ttft_s": None, "tpot_s": None, "e2e_s": None},
            "window": {"throughput.generation": 1234.0},
            "feasible": None,
        }
    }
    page = render_status(doc)
    assert "objective: throughput (configured: goodput)" in page
    assert "goodput has no targets" in page and "throughput 1234 tok/s" in page
