"""The door's in-flight cap as a controller (pure: no threads, no I/O; `now` is given, monotonic seconds).

A `Limiter` says the cap in force (`limit`; None: no cap), takes one `RequestSample` per answered request
(`record`) and, when asked on the door's loop (`step(now, queued)`), may move the cap: it returns the
`LimitChange` or None. Two implementations:

- `Static`: today's fixed cap (`[door] max_in_flight`, or a value the operator pinned with
  `tunerd door --max-in-flight N`). It never moves.
- `Goodput`: steered toward the operator's per-request targets (`[objective]` ttft_s, tpot_s, e2e_s,
  attainment) — the largest cap whose recent requests meet them.

The reference is Envoy's adaptive-concurrency filter (a gradient of the minimum to the sampled latency,
recomputed every sample window from the requests of that window, samples of requests started under an
older limit dropped by epoch; Netflix's concurrency-limits and AIMD gateways are the same family). What
differs here is the signal and the loop: an LLM server's latency is two figures with opposite answers to a
cap, and the door holds requests, so in a closed loop of clients a lower cap does not lower the load — it
moves the queue from vLLM into the door. On the H200 (issue 21) a cap stepped from none to 8 lowered
vLLM's TTFT p95 from 2.08 s to 0.018 s while the clients' TTFT p95 rose from 1.19 s to 6.18 s. So:

- **A request's TTFT is the client's** (core/slo.py): arrival at the door → first byte, the door's wait
  included. A cap is never credited for a TTFT it only moved into the door.
- **Each missed request is blamed on one side.** `upstream`: it missed its time per output token, or
  its TTFT or end-to-end time would have missed even without the door's wait (vLLM's own queue, prefill
  and decode: a smaller batch helps). `door`: it missed only because of its wait in the door (its
  upstream TTFT alone, its e2e less the wait, were within target: a larger cap helps).
- **The step** (every `interval_s`, from the fresh samples since the last step; with fewer than
  `min_samples` it waits and keeps collecting): attainment ≥ target → *met*: step up when requests wait in
  the door (the cap holds demand back), else hold. Missing, most misses upstream → step down (×`decrease`,
  at least 1, never below `low`) — from the most requests that were in flight in the interval when that
  was below the cap: a cap above the concurrency binds nothing, and from vLLM's default of 128 the goodput
  proof's CPU run took four steps of ~30 s and still stood at 40 with ~10 in flight. Missing, most misses
  the door's wait → step up (never down: that would only move the wait). No fresh answer, nothing waiting
  and nothing in flight: *idle* (an idle server is not failing); with requests in flight it is only too
  early to judge.
- **Up steps search, they do not saw.** The controller remembers the smallest cap seen missing upstream
  (`too_high`; the requests in flight when fewer ran than the cap allowed) and the largest seen missing by
  the door's wait (`too_low`) for `memory_s`; an up step goes halfway to `too_high`, or, while none is
  known, by 1, 2, 4, … (up steps in a row: a probe one above first, then faster); a down step goes no
  lower than the largest cap seen meeting the targets. Under a fixed latency curve it settles on the
  largest cap that meets them (one below `too_high`) instead of the sawtooth of plain AIMD; when the
  memory ages out it tries one above again, so a lighter load is found (at the cost of one interval above
  the knee every `memory_s`).
- **Stale samples are dropped**: after a change, a sample counts only when its request was forwarded at
  or after the change (its whole upstream time ran under the new cap), and, after the upstream came
  back (`reset`), only when it arrived after that (a hold across a restart is not the cap's wait).
- **Bounds**: `[door] min_in_flight` below; above, the max_num_seqs in force (vLLM runs no more at
  once: a larger cap changes nothing), or `CEILING` when it is not known. Back to the bounds before
  the last change (a reverted trial), the cap goes back to the one in force under them.
- **It cannot meet the targets** (`cannot_meet`) when the step it wants is blocked: missing upstream at
  the lower bound (or just above a cap that missed by the door's wait), or missing by the door's wait at
  the upper bound (or just below a cap that missed upstream). Then only a restart knob (a smaller batch,
  more KV cache) or more capacity can help: the tuner tries restart knobs only then (tune/proposer.py).
- **It keeps up with the arrivals** (Little's law; `step`'s `arrived`, the door's count of arrivals).
  When the door's backlog (queued + in flight) grew over the last `memory_s` by more than 2√arrivals
  (two sigma of the arrivals' Poisson noise), in each half of it, with requests waiting in the door,
  the cap answers fewer requests than arrive, and each one behind misses its TTFT by more. The cap goes
  up to the concurrency that keeps up, the arrival rate × the mean time in vLLM of the interval's
  answers (`keeps_up`), and no down step or hold goes below it for `SCORES_KEPT` memories. This wins
  over `too_high`: a growing backlog costs every later request its TTFT, a batch above the TPOT knee a
  part of each TPOT. On the goodput proof's CPU open loop at 0.57 req/s the cap walked to 3 and tunerd
  served 0.30× vLLM's defaults (docs/benchmarks.md); on the H200 at 8 req/s caps of 9–12 answered
  5.2–6.2/s and the door's queue reached 121 (docs/gpu.md, the fifth lease). A closed loop's backlog
  cannot grow (a client sends after its answer), and clients joining raise it once, in one half of the
  window: the rule does not fire there.
- **Out of reach, it holds what served best.** When the targets are missed upstream even where no down
  step is left, a smaller batch bought nothing on the way down: the controller goes back to the cap that
  served the most good requests a second (on a tie, the most answers a second) among those it judged in
  the last `SCORES_KEPT` memories with the door as it is now (a backlog waiting, or none) — once the
  door fell behind the arrivals, only among the caps that keep up — and holds it for `HOLD_MEMORIES`
  memories unless the targets are met or the door's wait is what misses. The same when the door's wait
  misses where no up step is left (the cap above missed upstream): boxed in, it holds what served best.
  Without this it stayed at the floor, where every request missed anyway and a tenth of the answers came (the
  goodput proof's CPU run: the cap at 3 of 16, 0 % in every window, throughput and the clients' TTFT
  collapsed).

Failed requests (5xx, cuts) are not the cap's doing and are left out of its judgment. Over 400 lines: the
rules above are one controller's, and its memory (what missed, what met, what each cap served) is read by
all of them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

from tunerd.core.slo import PerTarget, RequestSample, Targets, meets

Verdict = Literal["met", "upstream", "door", "few", "idle", "static"]
# vLLM's own upper bound of max_num_seqs (policy/tunables.py): the cap's ceiling when max_num_seqs is unknown.
CEILING = 1024
# A request that waited less than this in the door was not held back by the cap (the door's own
# overhead is tens of microseconds: bench/front_door.py).
WAITED_S = 0.001
# How long what each cap served is kept, and how long a cap is held once the targets are out of reach, in
# `memory_s`s: a walk down to the floor can take minutes when answers are slow (an interval waits for
# `min_samples`), and a hold re-checks the floor no more than every few minutes.
SCORES_KEPT = 10
HOLD_MEMORIES = 5


@dataclass(frozen=True, slots=True)
class LimitChange:
    """One move of the cap: `old` → `new` at `at` (monotonic), and why (for `door.limit`)."""

    old: int | None
    new: int | None
    at: float
    why: str


@dataclass(frozen=True, slots=True)
class LimitState:
    """What the controller reads and did (an immutable snapshot for `tunerd door` / `tunerd status`).

    `mode` "static" (a fixed cap) or "steered"; `limit` the cap in force (None: none); `low`/`high` the
    bounds; `samples` fresh samples in the current interval; the rest describe the last step:
    `verdict` (met / upstream / door misses / too few samples / idle), `attainment` overall and per
    target, `wait_share` (the door's wait over the clients' TTFT, summed), `door_miss_share` (the share of
    misses that only the door's wait caused), `last_at`/`last_why` of the last change, `changes` since
    the start, `cannot_meet` (see the module doc)."""

    mode: Literal["static", "steered"]
    limit: int | None
    low: int
    high: int | None
    interval_s: float
    samples: int = 0
    stale: int = 0
    verdict: Verdict = "static"
    attainment: float | None = None
    attainment_ttft: float | None = None
    attainment_tpot: float | None = None
    attainment_e2e: float | None = None
    attainment_target: float | None = None
    wait_share: float | None = None
    door_miss_share: float | None = None
    last_at: float | None = None
    last_why: str = ""
    changes: int = 0
    cannot_meet: bool = False
    too_high: int | None = None
    too_low: int | None = None
    keeps_up: int | None = None
    pinned: bool = False  # static because the operator (or `[door] max_in_flight`) fixed it

    @property
    def steering(self) -> bool:
        """Steered and still moving toward the targets: they are missed and the cap can still move."""
        return self.mode == "steered" and self.verdict in ("upstream", "door") and not self.cannot_meet


class Limiter(Protocol):
    """The door's cap controller (door's loop only)."""

    @property
    def limit(self) -> int | None: ...

    def record(self, sample: RequestSample) -> None: ...

    def step(
        self, now: float, queued: int, in_flight: int = 0, arrived: int | None = None
    ) -> LimitChange | None: ...

    def reset(self, now: float) -> None: ...

    def state(self) -> LimitState: ...


class Static:
    """A fixed cap (None: none). `record` and `step` do nothing: it is what the config or the operator
    said."""

    def __init__(self, limit: int | None, low: int = 1, high: int | None = None) -> None:
        self._limit = limit
        self._state = LimitState("static", limit, low, high, 0.0)

    @property
    def limit(self) -> int | None:
        return self._limit

    def record(self, sample: RequestSample) -> None:
        del sample

    def step(
        self, now: float, queued: int, in_flight: int = 0, arrived: int | None = None
    ) -> LimitChange | None:
        del now, queued, in_flight, arrived
        return None

    def reset(self, now: float) -> None:
        del now

    def state(self) -> LimitState:
        return self._state


@dataclass(frozen=True, slots=True)
class Judgment:
    """One interval's fresh samples judged against the targets (`judge`)."""

    n: int
    good: int
    misses_upstream: int
    misses_door: int
    waited: int
    attainment: tuple[float | None, float | None, float | None, float | None]  # all, ttft, tpot, e2e
    wait_share: float | None
    upstream_s: float | None = None  # the mean time in vLLM (end to end less the door's wait)


def judge(samples: list[RequestSample], targets: Targets) -> Judgment:
    """Attainment overall and per target, each miss blamed on vLLM (`upstream`) or on the door's wait
    (`door`: within every target had it not waited), and the mean time in vLLM. Answered requests only
    (pure)."""
    n = good = up = door = waited = 0
    per_target = PerTarget()
    wait_sum = ttft_sum = upstream_sum = 0.0
    for s in samples:
        if not s.ok:
            continue
        n += 1
        upstream_sum += s.e2e_s - s.wait_s
        verdict = meets(s, targets)
        per_target.add(verdict)
        if s.wait_s >= WAITED_S:
            waited += 1
        if s.ttft_s is not None:
            wait_sum += s.wait_s
            ttft_sum += s.ttft_s
        if False not in verdict:
            good += 1
        elif _upstream_miss(s, targets, verdict):
            up += 1
        else:
            door += 1
    shares = per_target.shares()
    return Judgment(
        n,
        good,
        up,
        door,
        waited,
        (good / n if n else None, *shares),  # type: ignore[arg-type]
        wait_sum / ttft_sum if ttft_sum > 0 else None,
        upstream_sum / n if n else None,
    )


def _upstream_miss(s: RequestSample, targets: Targets, verdict: tuple[bool | None, ...]) -> bool:
    """Whether the miss would remain without the door's wait: a TPOT miss, or a TTFT/e2e miss that vLLM's
    own part (TTFT less the wait; e2e less the wait) misses too."""
    ttft_ok, tpot_ok, e2e_ok = verdict
    if tpot_ok is False:
        return True
    if ttft_ok is False and targets.ttft_s is not None:
        upstream = s.upstream_ttft_s if s.upstream_ttft_s is not None else (s.ttft_s or 0.0) - s.wait_s
        if upstream > targets.ttft_s:
            return True
    return bool(e2e_ok is False and targets.e2e_s is not None and s.e2e_s - s.wait_s > targets.e2e_s)


@dataclass
class Goodput:
    """The cap steered toward `targets` (see the module doc). `limit` starts at `start` (clamped to the
    bounds; None: the upper bound). Door's loop only; every method takes `now` from the caller."""

    targets: Targets
    attainment: float
    low: int = 1
    high: int | None = None
    start: int | None = None
    interval_s: float = 5.0
    min_samples: int = 10
    decrease: float = 0.75
    memory_s: float = 60.0
    now: float = 0.0
    _limit: int = field(init=False)
    _fresh: list[RequestSample] = field(default_factory=list, init=False)
    _stale: int = field(default=0, init=False)
    _changed_at: float = field(default=-math.inf, init=False)  # forwarded before: stale
    _served_at: float = field(default=-math.inf, init=False)  # arrived before: stale (a restart's hold)
    _interval_start: float = field(init=False)
    _too_high: tuple[int, float] | None = field(default=None, init=False)  # (cap, seen at)
    _too_low: tuple[int, float] | None = field(default=None, init=False)
    _good: tuple[int, float] | None = field(default=None, init=False)
    _ups: int = field(default=0, init=False)  # up steps in a row: the next one is 2**_ups
    _peak: int = field(default=0, init=False)  # the most requests in flight seen in this interval
    # cap → (good requests/s, answers/s, judged at, a backlog in the door then): what each cap served
    _scores: dict[int, tuple[float, float, float, bool]] = field(default_factory=dict, init=False)
    _hold: tuple[int, float] | None = field(default=None, init=False)  # (cap, since): out of reach
    _keeps_up: tuple[int, float] | None = field(default=None, init=False)  # (cap, seen at): Little's law
    # (at, arrivals so far, queued + in flight) at each judged interval of the last `memory_s`
    _backlog: deque[tuple[float, int, int]] = field(default_factory=deque, init=False)
    # ((low, high), the cap in force under them) when the bounds last changed: a revert goes back to both
    _before: tuple[tuple[int, int | None], int] | None = field(default=None, init=False)
    _state: LimitState = field(init=False)

    def __post_init__(self) -> None:
        if not self.targets.any:
            raise ValueError("a steered cap needs at least one per-request target")
        if self.low < 1 or (self.high is not None and self.high < self.low):
            raise ValueError(f"bounds {self.low}..{self.high}: need 1 <= low <= high")
        self._limit = self._clamp(self.start if self.start is not None else self.ceiling)
        self._interval_start = self.now
        self._state = LimitState(
            "steered", self._limit, self.low, self.high, self.interval_s, attainment_target=self.attainment,
            verdict="few",
        )  # fmt: skip

    @property
    def ceiling(self) -> int:
        return self.high if self.high is not None else max(CEILING, self.low)

    @property
    def limit(self) -> int:
        return self._limit

    def _clamp(self, value: int) -> int:
        return max(self.low, min(self.ceiling, value))

    # -- inputs -------------------------------------------------------------------------------------

    def record(self, sample: RequestSample) -> None:
        """One answered request; kept for the current interval unless it is stale (forwarded before the
        last change, or arrived before the upstream last came back)."""
        arrived = sample.done - sample.e2e_s
        if arrived + sample.wait_s < self._changed_at or arrived < self._served_at:
            self._stale += 1
            return
        self._fresh.append(sample)

    def reset(self, now: float) -> None:
        """The upstream serves again (a restart, a new run): what arrived before is not the cap's doing,
        and what was learnt of the latency curve belongs to the old run."""
        self._served_at = now
        self._fresh = [s for s in self._fresh if s.done - s.e2e_s >= now]
        self._forget_curve()
        self._interval_start = now

    def set_bounds(self, low: int, high: int | None, now: float) -> LimitChange | None:
        """New bounds (max_num_seqs changed with a restart, or `[door] min_in_flight` by a reload): the
        cap is brought inside them; the curve's memory is forgotten. Back to the bounds in force before
        the last change (a reverted trial), the cap goes back to the one in force under them then: on
        the H100 the door had steered to 18, a trial's max_num_seqs 8 bounded it to 8, and after the
        revert it climbed from 8 again (docs/gpu.md, the seventh lease)."""
        if low < 1 or (high is not None and high < low):
            raise ValueError(f"bounds {low}..{high}: need 1 <= low <= high")
        if (low, high) == (self.low, self.high):
            return None  # a reload that changed nothing here: what was learnt stays
        before, self._before = self._before, ((self.low, self.high), self._limit)
        self.low, self.high = low, high
        self._state = replace(self._state, low=low, high=high)
        self._forget_curve()
        why = f"bounds {low}..{high if high is not None else '-'}"
        if before is not None and before[0] == (low, high):
            return self._move(
                self._clamp(before[1]), now, f"{why}: back to the cap in force under them, {before[1]}"
            )
        return self._move(self._clamp(self._limit), now, why)

    def set_targets(self, targets: Targets, attainment: float) -> None:
        if not targets.any:
            raise ValueError("a steered cap needs at least one per-request target")
        if (targets, attainment) == (self.targets, self.attainment):
            return
        self.targets, self.attainment = targets, attainment
        self._forget_curve()

    # -- the step -----------------------------------------------------------------------------------

    def step(
        self, now: float, queued: int, in_flight: int = 0, arrived: int | None = None
    ) -> LimitChange | None:
        """At most once per `interval_s`: judge the fresh samples and move the cap (or not). `queued`:
        requests waiting in the door now; `in_flight`: forwarded and not yet answered (0: none, or not
        known — then every down step is from the cap); `arrived`: the door's arrivals so far (None: not
        known — then the cap is not kept up with them). Called often: each call's `in_flight` counts."""
        self.now = now
        self._peak = max(self._peak, in_flight)
        if now - self._interval_start < self.interval_s:
            self._state = replace(self._state, samples=len(self._fresh), stale=self._stale)
            return None
        self._forget(now)
        samples, self._fresh = self._fresh, []
        j = judge(samples, self.targets)
        if j.n < self.min_samples:
            self._fresh = samples  # keep collecting: a verdict on a handful of requests is noise
            self._state = replace(self._state, samples=len(samples), stale=self._stale)
            if j.n == 0 and queued == 0 and in_flight == 0:
                # Nothing to judge: an idle server is not failing. With requests in flight it is only too
                # early — answers of several seconds leave intervals without one after a move — and an
                # "idle" there read as "not steering" let a rule's restart through while the cap was
                # still walking down (the goodput proof's open loop, CPU).
                self._publish(j, "idle", False)
            return None
        elapsed = max(now - self._interval_start, 1e-9)
        self._interval_start = now
        self._stale = 0
        attained = j.attainment[0]
        assert attained is not None
        cap = self._limit
        peak, self._peak = self._peak, in_flight
        self._scores[cap] = (j.good / elapsed, j.n / elapsed, now, queued > 0)
        need = self._behind(now, arrived, queued, in_flight, j.upstream_s)
        if need is not None:
            self._keeps_up = (need, now)  # published by the verdict's _publish below
        if attained >= self.attainment:
            self._hold = None
            self._good = (cap, now) if self._good is None or self._good[0] <= cap else self._good
            if self._too_low is not None and self._too_low[0] >= cap:
                self._too_low = None  # met where it missed: the curve moved
            if self._too_high is not None and self._too_high[0] <= cap:
                self._too_high = None
            held_back = queued > 0 or j.waited > 0
            new = self._up(cap) if held_back else cap
            why = f"met ({attained:.1%} ≥ {self.attainment:.0%})" + (
                ", requests wait in the door" if held_back else ""
            )
            self._publish(j, "met", False)
            if need is not None and need > new:
                return self._move(need, now, f"{why}; {self._behind_why(need)}")
            return self._move(new, now, why)
        if j.misses_upstream > j.misses_door:
            # What missed is the concurrency that ran, not a cap above it: remembered as 128 with ~8 in
            # flight, the next up step went halfway to it, to 67, and let in a backlog the cap never
            # drained again (the goodput proof's CPU open loop, docs/benchmarks.md).
            ran = min(cap, peak) if peak > 0 else cap
            self._too_high = (
                (ran, now) if self._too_high is None or ran <= self._too_high[0] else self._too_high
            )
            if self._good is not None and self._good[0] >= cap:
                self._good = None
            missed = (
                f"missed ({attained:.1%} < {self.attainment:.0%}), {j.misses_upstream} of "
                f"{j.misses_upstream + j.misses_door} misses upstream"
            )
            if need is not None and need > cap:
                # Out of the cap's reach: a batch that keeps up misses upstream. Only a restart knob (a
                # smaller batch that runs faster, more KV cache) or more capacity can meet both.
                self._publish(j, "upstream", True)
                return self._move(need, now, f"{missed}; {self._behind_why(need)}")
            if self._hold is not None and self._hold[0] == cap:
                self._publish(j, "upstream", True)
                return None  # out of reach: held where it served best
            new = self._down(cap, peak)
            if new == cap and (best := self._best_served(cap)) is not None:
                return self._hold_best(
                    best, now, j, "upstream", f"{missed} with no smaller batch left to try"
                )
            self._publish(j, "upstream", new == cap)
            return self._move(new, now, f"{missed}: a smaller batch")
        self._hold = None
        self._too_low = (cap, now) if self._too_low is None or cap >= self._too_low[0] else self._too_low
        new = self._up(cap)
        why = (
            f"missed ({attained:.1%} < {self.attainment:.0%}), {j.misses_door} of "
            f"{j.misses_upstream + j.misses_door} misses only by the door's wait: never a lower cap"
        )
        if need is not None and need > new:
            new, why = need, f"{why}; {self._behind_why(need)}"
        elif new == cap and (best := self._best_served(cap)) is not None:
            # Boxed in: the wait misses here and the cap above missed upstream. Staying put serves
            # nothing: on the H100's closed loop the cap sat 50 s at 9 at 0 good/s, between 9 (the
            # wait) and 10 (upstream), while 14 had served 2.80 good/s (docs/gpu.md, the eighth lease).
            return self._hold_best(best, now, j, "door", f"{why}, and no larger batch left to try")
        self._publish(j, "door", new == cap)
        return self._move(new, now, why)

    def _hold_best(
        self, best: int, now: float, j: Judgment, verdict: Verdict, why: str
    ) -> LimitChange | None:
        """Out of the cap's reach (`why`: what missed, with no step left to try): hold `best`, the cap that
        served best, and go back to it."""
        self._hold = (best, now)
        good, answers, _, _ = self._scores[best]
        self._publish(j, verdict, True)
        return self._move(
            best,
            now,
            f"{why}: the targets are out of the cap's reach; back to the cap that served best, {best} "
            f"({good:.2f} good/s, {answers:.2f} answers/s)",
        )

    def _behind(
        self, now: float, arrived: int | None, queued: int, in_flight: int, upstream_s: float | None
    ) -> int | None:
        """The concurrency that answers requests as fast as they arrive, when the door falls behind them:
        with requests waiting in the door, its backlog (queued + in flight) grew over the last `memory_s`
        by more than 2√arrivals (two sigma of the arrivals' Poisson noise), and grew in each half of it.
        By Little's law the arrival rate of that window × the mean time in vLLM of this interval's
        answers, clamped to the bounds (a larger batch's requests take no less: met again, it rises to
        where the two agree). None when the door keeps up or the arrivals are not known. Records this
        interval's point in `_backlog` (called once per judged interval).

        A closed loop's backlog cannot grow: its clients send only after an answer. More clients joining
        one raise it once, a step (in one half of the window), not a climb (in both)."""
        if arrived is None or upstream_s is None:
            return None
        seen = self._backlog
        seen.append((now, arrived, queued + in_flight))
        while len(seen) > 3 and now - seen[0][0] > self.memory_s:
            seen.popleft()
        if queued == 0 or len(seen) < 3:
            return None
        (then, arrived_then, first), (_, _, middle) = seen[0], seen[len(seen) // 2]
        arrivals = arrived - arrived_then
        if not first < middle < queued + in_flight or queued + in_flight - first <= 2 * math.sqrt(arrivals):
            return None
        return self._clamp(math.ceil(arrivals / (now - then) * upstream_s))

    def _behind_why(self, need: int) -> str:
        then, arrived_then, backlog_then = self._backlog[0]
        now, arrived, backlog = self._backlog[-1]
        rate = (arrived - arrived_then) / (now - then)
        return (
            f"the door's backlog grew from {backlog_then} to {backlog} in {now - then:.0f} s: cap "
            f"{self._limit} answers fewer than the {rate:.2f} arriving a second; up to {need}, the "
            "concurrency that keeps up (Little's law: arrivals × time in vLLM)"
        )

    def _up(self, cap: int) -> int:
        top = self.ceiling
        if self._too_high is not None:
            top = min(top, self._too_high[0] - 1)
            new = math.ceil((cap + self._too_high[0]) / 2)
        else:
            new = cap + 2**self._ups
        return max(cap, min(top, new))

    def _best_served(self, cap: int) -> int | None:
        """The judged cap that served strictly more than `cap` (good/s, then answers/s) with the door as
        `cap` was judged — both with a backlog waiting in the door, or both without — and, once the door
        fell behind the arrivals, at or above the cap that keeps up (`keeps_up`); or None. What a cap
        served from an empty queue is not what it serves under a backlog: on the H200's open loop the
        uncapped configuration's first seconds (7.6 good/s, nothing queued) outranked every cap judged
        minutes later with ~100 requests queued, and the hold went back to vLLM's defaults, to
        preemption and a restart trial (docs/gpu.md, the fourth lease). Below `keeps_up` a held cap
        grows the backlog: on the H200 at 8 req/s the holds went to caps 12, 11 and 9, which answered
        5.20–6.20 a second (docs/gpu.md, the fifth lease). Answers a second do not rank caps: a cap
        judged while it drained a queue answers more than arrive (on the H100 at 8 req/s, 9.20 a second
        at no cap, held twice over caps 13–16 that had met the targets: docs/gpu.md, the sixth lease),
        and in a closed loop the clients waiting are no backlog that grows (CI's goodput story held cap
        13 at 0 good/s for its 2.00 answers/s over cap 2, which had met them: fresh-clone run 21)."""
        mine = self._scores.get(cap)
        if mine is None:
            return None
        floor = self._keeps_up[0] if self._keeps_up is not None else 0
        alike = {c: score for c, score in self._scores.items() if score[3] == mine[3] and c >= floor}
        if not alike:
            return None
        best = max(alike, key=lambda c: alike[c][:2])
        if best == cap or (cap in alike and alike[best][:2] <= mine[:2]):
            return None
        return best

    def _down(self, cap: int, peak: int = 0) -> int:
        """The next cap down: ×`decrease` of the cap, or of `peak` (the most in flight in the interval)
        when that was below it; never below `low`, the largest cap that missed by the door's wait, the
        cap that keeps up with the arrivals, or the largest seen meeting the targets."""
        bottom = self.low
        if self._too_low is not None:
            bottom = max(bottom, self._too_low[0] + 1)
        if self._keeps_up is not None:
            bottom = max(bottom, self._keeps_up[0])
        if self._good is not None and self._good[0] < cap:
            bottom = max(bottom, self._good[0])
        binding = cap if peak <= 0 else min(cap, peak)
        new = min(cap - 1, math.floor(binding * self.decrease))
        return min(cap, max(bottom, new))

    def _forget_curve(self) -> None:
        """Forget what was learnt of the latency curve (a restart, new bounds or targets): the caps seen
        missing and meeting, what each cap served, and a hold."""
        self._too_high = self._too_low = self._good = self._keeps_up = None
        self._scores, self._hold = {}, None
        self._backlog.clear()
        self._publish_memory()

    def _forget(self, now: float) -> None:
        for name in ("_too_high", "_too_low", "_good"):
            seen = getattr(self, name)
            if seen is not None and now - seen[1] > self.memory_s:
                setattr(self, name, None)
        if self._keeps_up is not None and now - self._keeps_up[1] > SCORES_KEPT * self.memory_s:
            # Kept as long as the scores: an open loop's rate changes slowly, and a cap above it binds
            # nothing there (what runs is arrivals × time in vLLM). Forgotten after 5 memories, the walk
            # of tests/unit/test_door_limit.py's open loop went below it again every ~6 minutes, and the
            # backlog grew for a minute each time.
            self._keeps_up = None
        self._scores = {c: v for c, v in self._scores.items() if now - v[2] <= SCORES_KEPT * self.memory_s}
        if self._hold is not None and now - self._hold[1] > HOLD_MEMORIES * self.memory_s:
            self._hold = None
        self._publish_memory()

    def _publish_memory(self) -> None:
        """The snapshot forgets what the controller forgot (aged out, a restart, new bounds or targets):
        the tuner reads `too_low` as a concurrency lost under the load in force (tune/proposer.py)."""
        self._state = replace(
            self._state,
            too_high=self._too_high[0] if self._too_high is not None else None,
            too_low=self._too_low[0] if self._too_low is not None else None,
            keeps_up=self._keeps_up[0] if self._keeps_up is not None else None,
        )

    def _move(self, new: int, now: float, why: str) -> LimitChange | None:
        old = self._limit
        self._ups = self._ups + 1 if new > old else 0
        if new == old:
            return None
        self._limit = new
        self._changed_at = now
        self._fresh = []
        self._interval_start = now
        self._state = replace(
            self._state, limit=new, last_at=now, last_why=why, changes=self._state.changes + 1
        )
        return LimitChange(old, new, now, why)

    def _publish(self, j: Judgment, verdict: Verdict, cannot_meet: bool) -> None:
        misses = j.misses_upstream + j.misses_door
        self._state = replace(
            self._state,
            samples=len(self._fresh),
            stale=self._stale,
            verdict=verdict,
            attainment=j.attainment[0],
            attainment_ttft=j.attainment[1],
            attainment_tpot=j.attainment[2],
            attainment_e2e=j.attainment[3],
            attainment_target=self.attainment,
            wait_share=j.wait_share,
            door_miss_share=j.misses_door / misses if misses else None,
            cannot_meet=cannot_meet,
            too_high=self._too_high[0] if self._too_high is not None else None,
            too_low=self._too_low[0] if self._too_low is not None else None,
            keeps_up=self._keeps_up[0] if self._keeps_up is not None else None,
        )

    def state(self) -> LimitState:
        return self._state


class LimitLog:
    """The `door.limit` journal record, rate-limited (pure): the first change is told at once, later ones
    at most once per `every_s`, the latest pending one carrying the first `old` since the last record,
    the last `new` and `why`, and how many steps it sums (`steps`). Never a journal line per step."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self._told_at = -math.inf
        self._pending: dict[str, object] | None = None

    def add(self, change: LimitChange) -> dict[str, object] | None:
        """Note `change`; the record to journal now, or None (held until `due`)."""
        p = self._pending
        if p is None:
            self._pending = {"old": change.old, "new": change.new, "why": change.why, "steps": 1}
        else:
            p.update(new=change.new, why=change.why, steps=int(p["steps"]) + 1)  # type: ignore[call-overload]
        return self.due(change.at)

    def due(self, now: float) -> dict[str, object] | None:
        """The pending record when `every_s` has passed since the last one told (else None)."""
        if self._pending is None or now - self._told_at < self.every_s:
            return None
        record, self._pending, self._told_at = self._pending, None, now
        return record
