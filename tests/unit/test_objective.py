"""One objective (policy/objective.py): a name, a unit, a direction and a tolerance, read from one window
statistic; `better` and `worse` as every caller (verdict, exploration, recall, the memory) uses them."""

from __future__ import annotations

import typing

import pytest

from tests.unit.test_trial_verdict import ITL_SLOWER, saturated, unsaturated
from tunerd.config import TuningConfig, parse_config
from tunerd.config.objective import OBJECTIVE_NAMES, ObjectiveConfig
from tunerd.policy.evidence import WindowStats
from tunerd.policy.objective import (
    EXPLORE,
    OBJECTIVES,
    Goodput,
    ItlP95,
    Objective,
    Throughput,
    TtftP95,
    configured,
    direction_of,
    feasible,
    for_trial,
    objective,
)


def test_each_objective_has_a_name_a_unit_and_a_direction() -> None:
    described = {name: (cls.unit, cls.direction) for name, cls in OBJECTIVES.items()}
    assert described == {
        "throughput.generation": ("tok/s", "higher"),
        "ttft.p95": ("s", "lower"),
        "itl.p95": ("s", "lower"),
        "e2e.p95": ("s", "lower"),
        "slo.goodput": ("req/s", "higher"),
    }
    assert objective("ttft.p95", 0.1) == TtftP95(tolerance=0.1)
    assert (direction_of("itl.p95"), direction_of(None), direction_of("goodput.future")) == (
        "lower",
        None,
        None,
    )
    assert Throughput().fields() == {"objective_name": "throughput.generation", "objective_unit": "tok/s"}


def test_the_config_offers_every_objective_and_only_those() -> None:
    # config cannot import policy: its choices are a list of their own, held equal here.
    assert set(OBJECTIVE_NAMES.values()) == set(OBJECTIVES)
    kinds = typing.get_args(typing.get_type_hints(ObjectiveConfig)["kind"])
    assert set(kinds) == set(OBJECTIVE_NAMES)
    # The deprecated [tuning] objective names every objective (what trials compare: goodput too).
    old = typing.get_args(typing.get_type_hints(TuningConfig)["objective"])
    assert set(old) == set(OBJECTIVES)


def test_goodput_is_higher_better_in_the_unit_of_what_it_counts() -> None:
    targets = {"ttft_s": 1.0, "tpot_s": 0.05}
    requests = configured(ObjectiveConfig(kind="goodput", **targets), tolerance=0.05)
    tokens = configured(ObjectiveConfig(kind="goodput", count="tokens", **targets))
    assert requests == Goodput(tolerance=0.05) and requests.name == "slo.goodput"
    assert (requests.unit, tokens.unit, Goodput.unit) == ("req/s", "tok/s", "req/s")
    assert tokens.fields() == {"objective_name": "slo.goodput", "objective_unit": "tok/s"}
    assert tokens.describe(1234.0) == "1234 tok/s" and requests.describe(3.5) == "3.5 req/s"
    assert requests.better(11.0, 10.0) and not requests.better(10.2, 10.0) and requests.worse(9.0, 10.0)
    assert direction_of("slo.goodput") == "higher"
    assert configured(ObjectiveConfig(kind="itl.p95")) == ItlP95()
    assert configured(ObjectiveConfig()) == Goodput()  # the default kind (in force only with targets)


def test_goodput_reads_the_windows_slo_goodput_signal() -> None:
    window = saturated()
    with_goodput = type(window)(**{**window.__dict__, "values": {**window.values, "slo.goodput": 7.5}})
    assert Goodput().of(with_goodput) == 7.5
    assert Goodput().of(window) is None  # no door: no per-request measurement
    assert Goodput().of_probe({"probe.throughput": 512.0}) is None


def test_feasible_is_attainment_at_least_the_target() -> None:
    assert feasible(0.95, 0.95) is True
    assert feasible(0.9499, 0.95) is False
    assert feasible(1.0, 0.99) is True
    assert feasible(None, 0.95) is None  # nothing to judge: neither feasible nor not


def test_the_trials_compare_the_configured_objective_goodput_included() -> None:
    config = parse_config({"engine": {"model": "m"}, "objective": {"kind": "goodput", "ttft_s": 1.0}})
    assert config.tuning.objective == "slo.goodput"
    config = parse_config({"engine": {"model": "m"}, "objective": {"kind": "e2e.p95"}})
    assert config.tuning.objective == "e2e.p95"


def test_better_is_by_more_than_the_tolerance_in_the_objectives_direction() -> None:
    tput, ttft = Throughput(tolerance=0.05), TtftP95(tolerance=0.05)
    assert tput.better(106.0, 100.0) and not tput.better(104.0, 100.0) and not tput.better(90.0, 100.0)
    assert ttft.better(0.90, 1.0) and not ttft.better(0.97, 1.0) and not ttft.better(1.2, 1.0)
    # None is no measurement (infeasible, unknown): any value beats it, it beats nothing.
    assert tput.better(1.0, None) and ttft.better(5.0, None)
    assert not tput.better(None, 1.0) and not tput.better(None, None)


def test_worse_is_beyond_the_tolerance_and_unknown_when_it_cannot_be_told() -> None:
    tput, itl = Throughput(tolerance=0.05), ItlP95(tolerance=0.05)
    assert tput.worse(94.0, 100.0) is True and tput.worse(96.0, 100.0) is False
    assert itl.worse(0.0106, 0.01) is True and itl.worse(0.0104, 0.01) is False
    assert tput.worse(None, 100.0) is None and itl.worse(0.01, None) is None
    assert tput.worse(50.0, 0.0) is None  # a ratio to nothing


def test_rank_puts_the_best_value_first_whatever_the_direction() -> None:
    assert max((600.0, 1500.0, 900.0), key=Throughput().rank) == 1500.0
    assert max((0.4, 0.2, 0.3), key=TtftP95().rank) == 0.2


def test_describe_gives_the_value_with_its_unit() -> None:
    assert Throughput().describe(1234.4) == "1234 tok/s"
    assert ItlP95().describe(0.0123) == "12.3 ms"
    assert TtftP95().describe(2.5) == "2.5 s"
    assert Throughput().describe(None) == "unknown"


def test_an_objective_reads_one_window_statistic_and_the_probes_figure_of_it() -> None:
    window = saturated()
    assert Throughput().of(window) == window.throughput.median
    assert Throughput().samples(window) == window.throughput_samples
    assert ItlP95().of(window) == window.itl_p95 and ItlP95().samples(window) is None
    assert Throughput().of(None) is None
    probe = {"probe.throughput": 512.0, "probe.ttft_p95": 0.3, "probe.itl_p95": 0.01}
    assert (Throughput().of_probe(probe), TtftP95().of_probe(probe)) == (512.0, 0.3)
    assert objective("e2e.p95").of_probe(probe) is None  # the probe has no figure of it
    assert EXPLORE is Throughput


def test_a_trial_compares_throughput_only_when_both_windows_were_saturated() -> None:
    assert for_trial("throughput.generation", saturated(), saturated(), 0.05) == Throughput(tolerance=0.05)
    assert for_trial("throughput.generation", saturated(), unsaturated(), 0.05) == ItlP95(tolerance=0.05)
    assert for_trial("throughput.generation", unsaturated(), unsaturated(), 0.05) == ItlP95(tolerance=0.05)
    assert for_trial("ttft.p95", saturated(), saturated(), 0.05) == TtftP95(tolerance=0.05)


def test_adding_an_objective_is_one_class_reading_its_sensor_field() -> None:
    # What the next issue does for goodput: a class, and the window statistic it reads.
    class TtftP50(Objective):
        name: typing.ClassVar[str] = "ttft.p50"
        unit: typing.ClassVar[str] = "s"
        direction: typing.ClassVar[typing.Literal["higher", "lower"]] = "lower"

    try:
        window: WindowStats = unsaturated(itl_le=ITL_SLOWER)
        added = objective("ttft.p50", 0.05)
        assert isinstance(added, TtftP50) and added.of(window) == window.ttft_p50
        assert added.better(0.1, 0.2) and direction_of("ttft.p50") == "lower"
    finally:
        del OBJECTIVES["ttft.p50"]
    with pytest.raises(KeyError):
        objective("ttft.p50")
