"""tune/curve.py: the concurrency curve through the door's cap, cap by cap on one run, with a fake clock."""

from __future__ import annotations

from typing import Any

from tests.unit.test_trial_verdict import stats
from tunerd.policy.evidence import WindowStats
from tunerd.policy.objective import Throughput
from tunerd.tune.curve import CapCurve, parse_caps


class Journal:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def record(self, event: str, **fields: Any) -> None:
        self.records.append({"event": event, **fields})

    def of(self, event: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == event]


def run_curve(throughput_at: dict[int, float], noise: float = 0.0) -> tuple[Journal, list[tuple[str, Any]]]:
    """Measure a curve whose window serves `throughput_at[cap]` tok/s under the cap in force."""
    journal, door = Journal(), []
    current: dict[str, int] = {}

    def pin(cap: int, why: str) -> None:
        current["cap"] = cap
        door.append(("cap", cap))

    def window(start: float, end: float) -> WindowStats | None:
        assert end - start >= 10.0  # the settle time is not measured
        return stats(gen_per_s=throughput_at[current["cap"]], noise=noise, seed=current["cap"])

    now = 100.0
    curve = CapCurve(
        tuple(throughput_at),
        point_s=10.0,
        settle_s=2.0,
        goal=Throughput(),
        pin=pin,
        give_back=lambda: door.append(("given back", None)),
        window=window,
        recorder=journal,  # type: ignore[arg-type]
        trigger="t1",
        now=now,
    )
    for _ in range(1000):
        now += 0.5
        if curve.step(now):
            break
    return journal, door


def test_each_cap_is_measured_after_it_settles_and_the_cap_is_given_back() -> None:
    journal, door = run_curve({2: 50.0, 4: 100.0, 8: 104.0})
    assert door == [("cap", 2), ("cap", 4), ("cap", 8), ("given back", None)]
    points = journal.of("door.curve.point")
    assert [(p["cap"], p["objective"]) for p in points] == [(2, 50.0), (4, 100.0), (8, 104.0)]
    assert all(p["seconds"] == 10.0 for p in points)
    (done,) = journal.of("door.curve.finished")
    assert done["best"] == 8
    # 2 lost beyond the noise; 4 is within 4 % of 8, with no noise measured: lost only by its ratio.
    assert [lost["cap"] for lost in done["lost"]] == [2, 4]
    assert "the door's cap at 2 served 50 tok/s against 104 tok/s at 8 (-52%" in done["lost"][0]["why"]


def test_caps_within_their_noise_are_not_called_lost() -> None:
    journal, _ = run_curve({4: 100.0, 8: 104.0}, noise=0.5)  # ±50 % per second: a 4 % gap is noise
    (done,) = journal.of("door.curve.finished")
    point = journal.of("door.curve.point")[0]
    assert point["noise"] is not None and point["noise"] > 0.02
    assert done["lost"] == []


def test_the_caps_are_checked_before_anything_moves() -> None:
    assert parse_caps("2, 4,8") == (2, 4, 8)
    assert parse_caps("2,x") == "curve: 'x' is not a cap (a whole number ≥ 1)"
    assert parse_caps("0") == "curve: '0' is not a cap (a whole number ≥ 1)"
    assert parse_caps("2,2") == "curve: a cap is named twice"
    assert parse_caps("") == "curve: name the caps to measure, e.g. 2,4,8,16"
    assert parse_caps(",".join(str(i) for i in range(1, 40))) == "curve: 39 caps, at most 32"


def test_the_largest_cap_below_the_best_that_lost_is_what_max_num_seqs_must_not_go_to() -> None:
    from tunerd.tune.curve import CurvePoint, curve_lost_below_best

    def point(cap: int, value: float) -> CurvePoint:
        return CurvePoint(cap, 10.0, value, 0.01, value, None, None, None, None, None)

    points = [point(2, 40.0), point(4, 60.0), point(8, 100.0), point(16, 70.0)]
    lost = curve_lost_below_best(points, Throughput())
    assert lost is not None and lost.value == 4  # 16 lost too, but above the best: not a lower limit
    assert lost.why.startswith("the concurrency curve: the door's cap at 4 served 60 tok/s")
    assert curve_lost_below_best([point(8, 100.0), point(16, 99.0)], Throughput()) is None  # 8 ranks first


def test_a_cap_below_the_best_within_its_noise_is_not_worth_a_restart() -> None:
    # The H200's open loop (docs/gpu.md): the cap at 8 served less than no cap, inside both points'
    # noise; the restart to max_num_seqs 8 that followed cost 81.6 s and decided nothing.
    from tunerd.tune.curve import CurvePoint, curve_lost_below_best, lost_caps

    def point(cap: int, value: float) -> CurvePoint:
        return CurvePoint(cap, 10.0, value, 0.15, value, None, None, None, None, None)

    points = [point(8, 8.11), point(1024, 10.56)]
    assert lost_caps(points, Throughput()) == {}  # not lost beyond the noise
    lost = curve_lost_below_best(points, Throughput())
    assert lost is not None and lost.value == 8
    assert "within their noise: a restart to it buys no more than the cap" in lost.why
    # A tie buys nothing either: the larger cap ranks first.
    tie = curve_lost_below_best([point(8, 10.0), point(16, 10.0)], Throughput())
    assert tie is not None and tie.value == 8


def test_every_curve_of_the_run_counts_not_only_the_last() -> None:
    # The H100's closed loop (docs/gpu.md, the seventh lease): the curve lost cap 8 against no cap; the
    # next proposal, 10, won its own curve; with the last curve alone the slot forgot 8, measured it again,
    # and 8 won that 10 s point: a restart. Every curve of the run is remembered; another run's is not.
    from tunerd.tune.curve import CurvePoint, CurveSlot

    def point(cap: int, value: float) -> CurvePoint:
        return CurvePoint(cap, 10.0, value, 0.1, value, None, None, None, None, None)

    slot = CurveSlot()
    slot.keep(1, [point(8, 0.2), point(1024, 3.9)], Throughput())
    slot.keep(1, [point(10, 2.2), point(1024, 0.1)], Throughput())
    lost = slot.lost(1)
    assert lost is not None and lost.value == 8, lost
    assert slot.measured(1, 8) and slot.measured(1, 10) and not slot.measured(1, 12)
    assert slot.expected(1, 8, 1024) is not None and "at 8: 0.2 tok/s" in (slot.expected(1, 8, 1024) or "")
    slot.keep(2, [point(16, 5.0), point(32, 4.0)], Throughput())
    assert slot.lost(2) is None and not slot.measured(2, 8) and slot.lost(1) is None
