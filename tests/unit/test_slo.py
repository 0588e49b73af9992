"""Per-request service levels (core/slo.py) and how the door's meter turns one answer into a sample
(door/meter.py `Meter`): streamed, non-streamed, cut, one token; the window's attainment, goodput and
percentiles; the bounded ring. Times are given (a fake clock), never read."""

from __future__ import annotations

import pytest

from tunerd.core.slo import (
    RequestSample,
    SloWindow,
    Targets,
    good,
    meets,
    quantile,
    readings,
    tpot,
    window_stats,
)
from tunerd.door.meter import Meter, usage_tokens

ARRIVED = 100.0


def meter(
    *, sse: bool, first: float | None, last: float, events: int = 0, tail: bytes = b"", waited: float = 0.0
) -> Meter:
    m = Meter()
    m.sse, m.first, m.last, m.events, m.tail, m.waited = sse, first, last, events, tail, waited
    m.upstream_ttft = None if first is None else first - ARRIVED - waited
    return m


def sample(
    done: float = 10.0,
    *,
    ttft: float | None = 0.5,
    tpot_s: float | None = 0.02,
    e2e: float = 2.0,
    tokens: int | None = 100,
    ok: bool = True,
    wait: float = 0.0,
) -> RequestSample:
    return RequestSample(done, wait, ttft, ttft, tokens, True, tpot_s, e2e, tpot_s is not None, ok)


# -- one request ----------------------------------------------------------------------------------------


def test_a_streamed_answer_with_usage_counts_vllms_tokens_and_times_from_the_first_byte() -> None:
    usage = (
        b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":9,"total_tokens":19,"completion_tokens":10}}'
    )
    m = meter(
        sse=True, first=ARRIVED + 0.3, last=ARRIVED + 1.2, events=13, tail=usage + b"\n\ndata: [DONE]\n\n"
    )
    s = m.sample(ARRIVED, done=ARRIVED + 1.25)
    assert s.streamed and s.ok and s.tokens == 10 and s.tokens_exact
    assert s.ttft_s == pytest.approx(0.3) and s.e2e_s == pytest.approx(1.25)
    assert s.tpot_s == pytest.approx(0.9 / 9)  # (last − first) / (tokens − 1)


def test_a_stream_without_usage_counts_its_events_less_done_and_says_it_is_an_estimate() -> None:
    m = meter(sse=True, first=ARRIVED + 0.1, last=ARRIVED + 0.5, events=5, tail=b"data: [DONE]\n\n")
    s = m.sample(ARRIVED, ARRIVED + 0.5)
    assert s.tokens == 4 and not s.tokens_exact and s.tpot_s == pytest.approx(0.4 / 3)


def test_a_non_streamed_answer_has_its_end_to_end_time_as_ttft_and_no_tpot() -> None:
    body = b'{"choices":[{"text":"yyy"}],"usage":{"prompt_tokens":4,"total_tokens":7,"completion_tokens":3}}'
    m = meter(sse=False, first=ARRIVED + 0.9, last=ARRIVED + 0.9, tail=body, waited=0.4)
    s = m.sample(ARRIVED, ARRIVED + 1.0)
    assert not s.streamed and s.tokens == 3 and s.tokens_exact
    assert s.ttft_s == s.e2e_s == pytest.approx(1.0)  # the client saw nothing before the whole answer
    assert s.tpot_s is None and s.wait_s == 0.4
    # Judged on TTFT (= e2e) and e2e only: the TPOT target does not apply.
    assert meets(s, Targets(ttft_s=2.0, tpot_s=0.001)) == (True, None, None)
    assert not good(s, Targets(ttft_s=0.5))


def test_a_one_token_answer_has_no_tpot_and_is_judged_on_the_rest() -> None:
    usage = b'"usage":{"completion_tokens":1}}\n\ndata: [DONE]\n\n'
    s = meter(sse=True, first=ARRIVED + 0.2, last=ARRIVED + 0.2, events=3, tail=usage).sample(ARRIVED, 100.3)
    assert s.tokens == 1 and s.tpot_s is None
    assert meets(s, Targets(ttft_s=1.0, tpot_s=0.01)) == (True, None, None) and good(s, Targets(tpot_s=0.01))
    assert tpot(1.0, 2.0, 1) is None and tpot(1.0, 2.0, None) is None and tpot(1.0, 2.0, 3) == 0.5


def test_a_cut_stream_or_a_refusal_misses_every_target_set() -> None:
    cut = meter(sse=True, first=ARRIVED + 0.1, last=ARRIVED + 0.2, events=3)
    cut.ok = False
    s = cut.sample(ARRIVED, ARRIVED + 0.2)
    targets = Targets(ttft_s=1.0, tpot_s=1.0)
    assert not s.ok and meets(s, targets) == (False, False, None) and not good(s, targets)
    refused = meter(sse=False, first=None, last=0.0, waited=5.0)
    refused.ok = False
    r = refused.sample(ARRIVED, ARRIVED + 5.0)
    assert r.ttft_s is None and r.tokens is None and r.e2e_s == 5.0 and not good(r, targets)


def test_usage_tokens_reads_the_last_usage_object() -> None:
    both = b'"usage":{"completion_tokens": 3}}\n\ndata: {"usage":{"completion_tokens":17}}'
    assert usage_tokens(both) == 17  # continuous_usage_stats: every event has one, the last is the total
    assert usage_tokens(b"data: [DONE]\n\n") is None
    assert usage_tokens(b'"completion_tokens":') is None  # cut after the key: unknown, not 0


# -- a window -------------------------------------------------------------------------------------------


def test_attainment_is_the_share_of_requests_that_met_every_target_and_each_target_its_own() -> None:
    targets = Targets(ttft_s=1.0, tpot_s=0.05)
    samples = [
        sample(ttft=0.5, tpot_s=0.02),  # good
        sample(ttft=1.5, tpot_s=0.02),  # TTFT missed
        sample(ttft=0.5, tpot_s=0.08),  # TPOT missed
        sample(ttft=0.5, tpot_s=None, tokens=1),  # one token: judged on TTFT only — good
        sample(ttft=None, tpot_s=None, tokens=None, ok=False),  # failed: misses both
    ]
    stats = window_stats(samples, targets, "requests", span_s=10.0)
    assert stats.requests == 5 and stats.attainment == pytest.approx(2 / 5)
    assert stats.attainment_ttft == pytest.approx(3 / 5)
    assert stats.attainment_tpot == pytest.approx(2 / 4)  # of the four with a TPOT (or failed)
    assert stats.attainment_e2e is None  # no e2e target
    assert stats.goodput == pytest.approx(2 / 10.0)
    tokens = window_stats(samples, targets, "tokens", span_s=10.0)
    assert tokens.goodput == pytest.approx((100 + 1) / 10.0)


def test_without_targets_there_is_no_attainment_but_the_percentiles_are_there() -> None:
    samples = [sample(ttft=t, tpot_s=t / 10) for t in (0.1, 0.2, 0.3, 0.4, 0.5)]
    stats = window_stats(samples, Targets(), "requests", span_s=10.0)
    assert stats.attainment is None and stats.goodput is None
    assert stats.ttft_p50 == pytest.approx(0.3) and stats.ttft_p95 == pytest.approx(0.48)
    assert stats.tpot_p95 == pytest.approx(0.048)
    assert quantile([], 0.5) is None and quantile([2.0], 0.95) == 2.0


def test_percentiles_are_over_answered_requests_and_include_the_doors_wait() -> None:
    samples = [sample(ttft=0.2, wait=0.0), sample(ttft=3.0, wait=2.9), sample(ttft=None, ok=False, wait=9.0)]
    stats = window_stats(samples, Targets(ttft_s=1.0), "requests", span_s=1.0)
    assert stats.ttft_p50 == pytest.approx(1.6)  # the failed one has no TTFT
    assert stats.wait_p95 is not None and stats.wait_p95 > 8.0  # the door's wait is its own figure


def test_the_window_keeps_only_its_last_seconds_and_the_ring_stays_bounded() -> None:
    window = SloWindow(60.0, size=4, started=0.0)
    window.add([sample(done=t) for t in (10.0, 20.0, 30.0)])
    targets = Targets(ttft_s=1.0)
    assert window.stats(70.0, targets, "requests").requests == 2  # 10.0 left the window
    stats = window.stats(30.0, targets, "requests")
    assert stats.requests == 3 and stats.span_s == 30.0  # observed for 30 s only, not 60
    window.add([sample(done=t) for t in (31.0, 32.0, 33.0)])
    assert len(window) == 4 and window.total == 6  # bounded: the two oldest dropped
    stats = window.stats(33.0, targets, "requests")
    # What the ring dropped (up to 20.0) is not counted as zero: the window covers what it still holds.
    assert stats.requests == 4 and stats.span_s == pytest.approx(33.0 - 20.0)
    assert stats.goodput == pytest.approx(4 / 13.0)


def test_readings_are_unknown_not_zero_when_nothing_was_measured() -> None:
    idle = window_stats([], Targets(ttft_s=1.0), "requests", span_s=60.0)
    r = readings(idle, door_waiting=0)
    assert r["door.waiting"] == 0.0 and r["slo.requests"] == 0.0
    assert r["slo.attainment"] is None and r["slo.goodput"] is None and r["door.ttft.p95"] is None
    busy = window_stats([sample(ttft=0.5)], Targets(ttft_s=1.0), "requests", span_s=60.0)
    r = readings(busy, door_waiting=3)
    assert (r["slo.attainment"], r["slo.attainment.ttft"], r["door.waiting"]) == (1.0, 1.0, 3.0)
    assert r["slo.attainment.tpot"] is None
