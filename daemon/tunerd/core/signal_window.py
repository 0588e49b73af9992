"""Sliding windows of polled samples → named signals with units (docs/signals.md): the ONE definition
of every signal name. The rules read the daemon's live window (supervisor.py); a trial's before and after
windows, the verdict's `eased` and the baseline replay a window of the same class over one run's polls
(policy/evidence.window_signals), so that a name is the same statistic wherever it is read. It lives in
`core` because both `observe` (sensors) and `policy` (decisions) use it and neither imports the other.

Pure: the caller passes `time.monotonic()` stamps; nothing here reads a clock or does I/O. Each poll
feeds the `EngineSample` (None when the scrape failed) and host/GPU readings by name (`host.*`,
`engine.*`, `gpu.*`, as the collectors' `as_readings()` give them). Any numeric input can be fed by
name: names ending in `_total` (plus `extra_counters`) are counters, all others gauges.

- None, NaN or ±inf is a *missing* reading, never 0; an empty window yields no signal (all None).
- Counter rates survive a vLLM restart: a decrease is a reset and the new value counts from zero
  (Prometheus `rate()`), so a rate is never negative. Histograms are handled the same way, per bucket.
- Quantiles interpolate inside the bucket like Prometheus `histogram_quantile`, over the bucket
  increases in the window; no observation in the window → None. Each quantile `q` also gives the edges
  of the bucket it falls in, `q.lo` and `q.hi` (`bounds`, `quantile_bucket`): what the histogram knows;
  the interpolated value inside is a guess (issue 21: TTFT p95 2.02 s between the 1.0 and 2.5 s edges
  while no client waited over 1.26 s).
Cost: a poll appends to one deque per input, dropping that series' points older than the window as it
goes; rates and quantiles use only the first and last point of a series (resets are folded into an
offset at add time), max and min a monotonic queue, so no signal re-scans the window; signals are
computed per kind and cached until the next poll (bench/poll_cost.py measures the whole poll). Over 400
lines: one definition per signal name, in one place (docs/signals.md).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping
from math import isfinite
from operator import add, attrgetter, lt, sub
from typing import TYPE_CHECKING

from tunerd.core.engine_sample import bucket_quantile, histogram_quantile, monotonic_counts, quantile_bucket
from tunerd.core.signal_catalog import (
    KEY_INDICATORS,
    KV_FULL_USAGE,
    SIGNAL_TABLE,
    SIGNALS,
    SignalSpec,
    signals_markdown,
)

if TYPE_CHECKING:
    from tunerd.core.engine_sample import EngineSample, Histogram

__all__ = [
    "EXTRA_COUNTERS",
    "KEY_INDICATORS",
    "SIGNALS",
    "SignalSpec",
    "SignalWindow",
    "histogram_quantile",
    "quantile_bucket_of",
    "signals_markdown",
]

# Counters whose names do not end in `_total` (PSI stall time in microseconds).
EXTRA_COUNTERS = frozenset({"host.psi_some_total_us", "host.psi_full_total_us"})
_ENGINE_FIELDS = (
    "kv_cache_usage", "requests_running", "requests_waiting", "preemptions_total", "prompt_tokens_total",
    "generation_tokens_total", "prefix_cache_queries_total", "prefix_cache_hits_total",
)  # fmt: skip
# Input "vllm.<field>"; request_tpot has no percentile signal (read by `histogram_increase`).
_ENGINE_HISTOGRAMS = ("ttft", "inter_token_latency", "e2e_latency", "queue_time", "request_tpot")
_ENGINE_INPUTS = tuple("vllm." + f for f in _ENGINE_FIELDS)
_HISTOGRAM_INPUTS = tuple("vllm." + f for f in _ENGINE_HISTOGRAMS)
_engine_fields = attrgetter(*_ENGINE_FIELDS)  # one C call for the eight fields
_engine_histograms = attrgetter(*_ENGINE_HISTOGRAMS)


_NAMES = tuple(s.name for s in SIGNALS)
# The catalogue by kind, so that `signals()` runs one tight loop per kind instead of dispatching 53 times.
_BY_KIND: dict[str, list[tuple[str, object]]] = {}
for _name, _, _kind, _arg, _, _ in SIGNAL_TABLE:
    _BY_KIND.setdefault(_kind, []).append((_name, _arg))
_LAST, _AVG, _MAX, _MIN, _RATE = (tuple(_BY_KIND.get(k, ())) for k in ("last", "avg", "max", "min", "rate"))
_RATIO = tuple(_BY_KIND.get("ratio", ()))
_EXTREMES_INPUTS = frozenset(arg for _, arg in (*_MAX, *_MIN))
_QUANTILES: dict[str, tuple[tuple[str, float], ...]] = {}
for _name, (_input, _q) in _BY_KIND["quantile"]:  # type: ignore[misc]
    _QUANTILES[_input] = (*_QUANTILES.get(_input, ()), (_name, _q))


class _Series:
    """Present readings of one input inside the window. Counters store `raw + offset`, where offset
    grows by the last value seen before each reset (a gauge's offset stays None); histograms store the
    raw bucket vector and an offset vector shared by consecutive points until a reset."""

    __slots__ = ("les", "offset", "raw_last", "stats", "times", "values")

    def __init__(self, les: tuple[float, ...] | None = None) -> None:
        self.times: deque[float] = deque()
        self.values: deque = deque()
        self.les = les
        self.raw_last = self.offset = None
        self.stats: _Extremes | None = None  # kept for the gauges whose max or min is a signal


class _Extremes:
    """The window's max and min of one gauge, kept as points come and go (monotonic queues), so that
    they cost the same however many polls the window holds. (Averages stay an exact `math.fsum`.)

    `high`/`low` hold (time, value) with values strictly decreasing/increasing: the max/min is the first.
    """

    __slots__ = ("high", "low")

    def __init__(self) -> None:
        self.high: deque[tuple[float, float]] = deque()
        self.low: deque[tuple[float, float]] = deque()

    def push(self, now: float, value: float) -> None:
        high, low = self.high, self.low
        while high and high[-1][1] <= value:
            high.pop()
        high.append((now, value))
        while low and low[-1][1] >= value:
            low.pop()
        low.append((now, value))

    def evict(self, cutoff: float) -> None:
        """Forget the points before `cutoff`."""
        high, low = self.high, self.low
        while high and high[0][0] < cutoff:
            high.popleft()
        while low and low[0][0] < cutoff:
            low.popleft()


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None or den <= 0 else num / den


class SignalWindow:
    """Polls of the last `window_s` seconds and the signals computed from them (see module doc)."""

    def __init__(self, window_s: float = 60.0, *, extra_counters: Iterable[str] = EXTRA_COUNTERS) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._counters = frozenset(extra_counters)
        self._polls: deque[float] = deque()
        self._latest: dict[str, float | None] = {}
        self._gauges: dict[str, _Series] = {}
        self._counts: dict[str, _Series] = {}
        self._hists: dict[str, _Series] = {}
        self._route: dict[str, _Series] = {}  # gauges and counters by input name
        self._cache: dict[str, float | None] | None = None
        self._deltas: dict[str, tuple[float, tuple[float, ...]] | None] = {}  # per poll, for 3 quantiles

    def __len__(self) -> int:
        """Polls inside the window."""
        return len(self._polls)

    def add(
        self,
        now: float,
        engine: EngineSample | None,
        readings: Mapping[str, float | None] = {},
        *,
        scraped: bool = True,
    ) -> None:
        """Record one poll at monotonic time `now` (never earlier than the previous poll, else
        ValueError): the engine sample (None: the scrape failed) and any readings by name.
        `scraped` False: no scrape was attempted (vLLM not serving yet), so `scrape.up` is unknown."""
        polls = self._polls
        if polls and now < polls[-1]:
            raise ValueError(f"poll at {now} is earlier than the previous one at {polls[-1]}")
        # None, NaN and ±inf are missing readings.
        inputs = {n: None if v is None or not isfinite(v) else float(v) for n, v in readings.items()}
        inputs.update(_derived(inputs))
        inputs["scrape.up"] = (0.0 if engine is None else 1.0) if scraped else None
        cutoff = now - self.window_s
        appended = 0
        if engine is not None:
            for name, value in zip(_ENGINE_INPUTS, _engine_fields(engine), strict=True):
                inputs[name] = None if value is None or not isfinite(value) else float(value)
            # 1/0 per poll: the cache full at this poll; its window mean is `kv_cache.full_share`.
            usage = inputs["vllm.kv_cache_usage"]
            inputs["vllm.kv_cache_full"] = None if usage is None else float(usage >= KV_FULL_USAGE)
            inputs["vllm.kv_cache_size_tokens"] = _parse_number(
                (engine.cache_config or {}).get("kv_cache_size_tokens")
            )
            for name, hist in zip(_HISTOGRAM_INPUTS, _engine_histograms(engine), strict=True):
                if hist is not None:
                    self._add_histogram(now, cutoff, name, hist)
                    appended += 1
        route = self._route
        for name, value in inputs.items():
            if value is None:
                continue
            series = route.get(name)
            if series is None:
                series = self._new_series(name)
            times, values = series.times, series.values
            if times and times[0] < cutoff:  # at 1 Hz, the one point that just left the window
                _evict(series, cutoff)
            times.append(now)
            offset = series.offset
            if offset is None:  # a gauge
                values.append(value)
                if series.stats is not None:
                    series.stats.push(now, value)
            else:  # a counter: a decrease is a reset, the new value counts from zero
                last = series.raw_last
                if last is not None and value < last:
                    offset = series.offset = offset + last
                series.raw_last = value
                values.append(value + offset)
            appended += 1
        polls.append(now)
        while polls[0] < cutoff:
            polls.popleft()
        self._latest = inputs
        self._cache = None
        self._deltas.clear()
        # Every series fed just now dropped its own old points; one that was not fed (a missing
        # reading, a failed scrape) may still hold points older than the window: look at all of them.
        if appended < len(route) + len(self._hists):
            self._evict_all(cutoff)

    def _new_series(self, name: str) -> _Series:
        series = _Series()
        if name.endswith("_total") or name in self._counters:
            series.offset = 0.0  # a counter (gauges keep offset None)
            self._counts[name] = series
        else:
            self._gauges[name] = series
            if name in _EXTREMES_INPUTS:
                series.stats = _Extremes()
        self._route[name] = series
        return series

    def _add_histogram(self, now: float, cutoff: float, name: str, hist: Histogram) -> None:
        les, counts = tuple(zip(*hist.buckets, strict=True)) or ((), ())
        series = self._hists.get(name)
        if series is None or series.les != les:  # new, or another bucket layout: start afresh
            series = self._hists[name] = _Series(les)
            series.offset = (0.0,) * len(les)
        elif any(map(lt, counts, series.raw_last)):
            series.offset = tuple(map(add, series.offset, series.raw_last))
        series.raw_last = counts
        if series.times and series.times[0] < cutoff:
            _evict(series, cutoff)
        series.times.append(now)
        series.values.append((counts, series.offset))

    def _evict_all(self, cutoff: float) -> None:
        for table in (self._gauges, self._counts, self._hists):
            for name in [n for n, s in table.items() if s.times[0] < cutoff]:
                series = table[name]
                _evict(series, cutoff)
                if not series.times:
                    del table[name]
                    if table is not self._hists:
                        del self._route[name]

    # --- accessors over any input name -------------------------------------------------------------
    def last(self, name: str) -> float | None:
        """The input's value at the latest poll (None if that poll lacked it)."""
        return self._latest.get(name)

    def avg(self, name: str) -> float | None:
        """Mean of the input's readings in the window."""
        series = self._gauges.get(name)
        return math.fsum(series.values) / len(series.values) if series else None

    def max(self, name: str) -> float | None:
        series = self._gauges.get(name)
        if not series:
            return None
        return series.stats.high[0][1] if series.stats else max(series.values)

    def min(self, name: str) -> float | None:
        series = self._gauges.get(name)
        if not series:
            return None
        return series.stats.low[0][1] if series.stats else min(series.values)

    def increase(self, name: str) -> tuple[float, float] | None:
        """(increase, seconds) of a counter between its first and last reading in the window, resets
        counted from zero; for a histogram input, of its observation count."""
        series = self._counts.get(name)
        if series is not None and len(series.times) > 1:
            return series.values[-1] - series.values[0], series.times[-1] - series.times[0]
        delta = self._bucket_increase(name)
        return None if delta is None else (delta[1][-1], delta[0])

    def rate(self, name: str) -> float | None:
        """Per-second increase of a counter (or histogram count) over the window; never negative."""
        inc = self.increase(name)
        return None if inc is None or inc[1] <= 0 else inc[0] / inc[1]

    def histogram_increase(self, name: str) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
        """(bucket edges, per-bucket cumulative increase) of histogram input `name` ("vllm.ttft", …)
        between the window's first and last poll, resets counted from zero; None with fewer than two
        polls of it. For estimates at a target (core/slo_estimate.py)."""
        delta = self._bucket_increase(name)
        return None if delta is None else (self._hists[name].les, delta[1])  # type: ignore[return-value]

    def _bucket_increase(self, name: str) -> tuple[float, tuple[float, ...]] | None:
        """(seconds, per-bucket cumulative increase) between the window's first and last histogram."""
        if name in self._deltas:
            return self._deltas[name]
        series, delta = self._hists.get(name), None
        if series is not None and len(series.times) > 1 and series.les:
            (first, first_off), (last, last_off) = series.values[0], series.values[-1]
            if first_off is not last_off:  # a reset in between: compare raw + offset
                first, last = tuple(map(add, first, first_off)), tuple(map(add, last, last_off))
            delta = series.times[-1] - series.times[0], tuple(map(sub, last, first))
        self._deltas[name] = delta
        return delta

    def signals(self) -> Mapping[str, float | None]:
        """Every signal of `SIGNALS` by name, None where unknown; cached until the next `add`."""
        if self._cache is not None:
            return self._cache
        out: dict[str, float | None] = dict.fromkeys(_NAMES)
        if self._polls:
            latest, gauges = self._latest, self._gauges
            for signal, arg in _LAST:
                out[signal] = latest.get(arg)
            for signal, arg in _AVG:
                series = gauges.get(arg)
                if series:
                    out[signal] = math.fsum(series.values) / len(series.values)
            for signal, arg in _MAX:  # these inputs and those of _MIN have _Extremes
                series = gauges.get(arg)
                if series:
                    out[signal] = series.stats.high[0][1]  # type: ignore[union-attr]
            for signal, arg in _MIN:
                series = gauges.get(arg)
                if series:
                    out[signal] = series.stats.low[0][1]  # type: ignore[union-attr]
            counts = self._counts
            for signal, arg in _RATE:
                series = counts.get(arg)
                if series is not None and len(series.times) > 1:  # `rate`, inlined for counters
                    seconds = series.times[-1] - series.times[0]
                    if seconds > 0:
                        out[signal] = (series.values[-1] - series.values[0]) / seconds
                else:
                    out[signal] = self.rate(arg)
            for signal, (numerator, denominator) in _RATIO:
                num, den = self.increase(numerator), self.increase(denominator)
                out[signal] = _ratio(num[0], den[0]) if num and den else None
            for name, wanted in _QUANTILES.items():
                self._quantiles(name, wanted, out)
        self._cache = out
        return out

    def _quantiles(
        self, name: str, wanted: tuple[tuple[str, float], ...], out: dict[str, float | None]
    ) -> None:
        # The three quantiles of one histogram share its bucket increase and its monotonic counts.
        delta = self._bucket_increase(name)
        if delta is None or max(delta[1]) <= 0:  # no observation in the window (an idle engine)
            return
        les = self._hists[name].les
        if len(les) < 2 or les[-1] != math.inf:  # type: ignore[index]
            return
        counts = monotonic_counts(delta[1])
        for signal, q in wanted:
            out[signal] = bucket_quantile(q, les, counts)  # type: ignore[arg-type]
            edges = quantile_bucket(q, les, counts)  # type: ignore[arg-type]
            if edges is not None:  # the +Inf bucket's upper edge is None: no edge (JSON has no inf)
                out[signal + ".lo"], out[signal + ".hi"] = edges[0], edges[1] if isfinite(edges[1]) else None

    def bounds(self, name: str) -> tuple[float, float] | None:
        """The bucket `(lo, hi]` the histogram quantile signal `name` (`ttft.p95`, ...) falls in, hi inf in
        the `+Inf` bucket; None when `name` is unknown or not a histogram quantile."""
        return quantile_bucket_of(self.signals(), name)

    def update(
        self,
        now: float,
        engine: EngineSample | None,
        readings: Mapping[str, float | None] = {},
        *,
        scraped: bool = True,
    ) -> Mapping[str, float | None]:
        """`add` then `signals`: the per-poll call."""
        self.add(now, engine, readings, scraped=scraped)
        return self.signals()


def quantile_bucket_of(signals: Mapping[str, float | None], name: str) -> tuple[float, float] | None:
    """The bucket `(lo, hi]` of the histogram quantile `name` from its edge signals `name.lo`, `name.hi`
    (a window's, a trial's or the live signals): hi inf where `name.hi` is None beside a known lower edge
    (the `+Inf` bucket). None when the lower edge is unknown: an exact figure (`door.ttft.p95`), a signal
    that is not a histogram quantile, or no observation."""
    if signals.get(name) is None:
        return None
    lo = signals.get(name + ".lo")
    if lo is None:
        return None
    hi = signals.get(name + ".hi")
    return lo, math.inf if hi is None else hi


def _evict(series: _Series, cutoff: float) -> None:
    times, values = series.times, series.values
    while times and times[0] < cutoff:
        times.popleft()
        values.popleft()
    if series.stats is not None:
        series.stats.evict(cutoff)


def _parse_number(text: str | None) -> float | None:
    try:
        value = float(text) if text is not None else None
    except ValueError:  # vLLM writes "None" for unset config values
        return None
    return value if value is not None and isfinite(value) else None


def _derived(r: Mapping[str, float | None]) -> dict[str, float | None]:
    """Inputs computed from other readings of the same poll, so that windows apply to them too."""
    avail, total = r.get("host.mem_available_bytes"), r.get("host.mem_total_bytes")
    used, gtotal = r.get("gpu.mem_used_bytes"), r.get("gpu.mem_total_bytes")
    tx, rx = r.get("gpu.pcie_tx_bytes_per_s"), r.get("gpu.pcie_rx_bytes_per_s")
    minflt, majflt = r.get("engine.minflt_total"), r.get("engine.majflt_total")
    free = _ratio(avail, total)
    return {
        "host.mem_used_ratio": None if free is None else 1.0 - free,
        "gpu.mem_used_ratio": _ratio(used, gtotal),
        "gpu.migration_bytes_per_s": None if tx is None or rx is None else tx + rx,
        "engine.faults_total": None if minflt is None or majflt is None else minflt + majflt,
    }
