"""tunerd's own Prometheus metrics (tunerd_*), in one registry per daemon.

The main loop sets them as things happen; the HTTP face serves the registry. Names follow the exporter
conventions: `tunerd_` prefix, base units, counters end in `_total`, an `_up` gauge for the scrape.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tunerd.core.slo import SloStats, Targets
from tunerd.core.states import EngineState

# Signal units (core/signal_catalog.py) → Prometheus base-unit suffixes (exporter naming conventions).
_UNIT_SUFFIX = {
    "ratio 0..1": "ratio",
    "1/0": "",
    "1/s": "per_second",
    "s": "seconds",
    "bytes": "bytes",
    "bytes/s": "bytes_per_second",
    "tokens": "tokens",
    "tokens/s": "tokens_per_second",
    "pages/s": "pages_per_second",
    "percent": "percent",
    "requests": "",
}


def signal_metric_name(signal_name: str, unit: str) -> str:
    """`kv_cache.usage` in `ratio 0..1` → `tunerd_signal_kv_cache_usage_ratio`.

    The unit's suffix is left out when the name already says it (`host.mem_available_bytes_min`).
    """
    words = signal_name.replace(".", "_").replace("-", "_")
    suffix = _UNIT_SUFFIX.get(unit, "")
    if suffix and suffix.split("_")[0] in words.split("_"):
        suffix = ""
    return f"tunerd_signal_{words}" + (f"_{suffix}" if suffix else "")


class Metrics:
    """The tunerd_* families in one registry (a fresh one per daemon; tests pass their own)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.engine_up = Gauge(
            "tunerd_engine_up", "1 when vLLM is RUNNING (its /health answered 200)", registry=r
        )
        self.engine_state = Gauge(
            "tunerd_engine_state",
            "Engine state: " + ", ".join(f"{s.value}={s.name}" for s in EngineState),
            registry=r,
        )
        self.restarts = Counter(
            "tunerd_engine_restarts",
            "Engine failures that led to a restart, by classified reason",
            ["reason"],
            registry=r,
        )
        self.scrape_up = Gauge(
            "tunerd_engine_scrape_up", "1 when the last scrape of vLLM's /metrics worked", registry=r
        )
        self.param = Gauge(
            "tunerd_param", "Engine parameters in force (booleans as 0/1)", ["name"], registry=r
        )
        self.kv_cache_tokens = Gauge(
            "tunerd_engine_kv_cache_tokens", "KV-cache capacity vLLM reported at its last start", registry=r
        )
        self.reload_ok = Gauge(
            "tunerd_config_last_reload_successful", "1 when the last config (re)load succeeded", registry=r
        )
        self.reload_time = Gauge(
            "tunerd_config_last_reload_success_timestamp_seconds", "When the config last loaded", registry=r
        )
        self.journal_errors = Counter(
            "tunerd_journal_write_errors", "Journal records that could not be made durable", registry=r
        )
        self.rule_active = Gauge(
            "tunerd_rule_active",
            "1 while a rule's condition holds (0: does not hold or unknown)",
            ["rule"],
            registry=r,
        )
        self.trials = Counter("tunerd_trials", "Tuning trials by outcome", ["outcome"], registry=r)
        self.tuning_mode = Gauge(
            "tunerd_tuning_mode", "Tuning mode: 2=auto, 1=dry-run, 0=off, -1=paused", registry=r
        )
        self.restart_budget = Gauge(
            "tunerd_restart_budget_remaining",
            "Trial restarts left in the hourly and daily budget",
            registry=r,
        )
        self.trial_phase = Gauge(
            "tunerd_trial_phase",
            "Trial phase (tune/experiment.py): 0=none, 1=planning, 2=applying (restarting), 3=warm-up, "
            "4=measuring (the after window), 5=reverting",
            registry=r,
        )
        # Per-request service levels, from the front door's samples over the observe window (core/slo.py).
        self.slo_attainment = Gauge(
            "tunerd_slo_attainment_ratio",
            "Share of the window's requests that met every [objective] target (NaN: no target or request)",
            registry=r,
        )
        self.slo_target_attainment = Gauge(
            "tunerd_slo_target_attainment_ratio",
            "Share of the window's requests within one target (ttft, tpot, e2e; NaN: not set or none)",
            ["target"],
            registry=r,
        )
        self.slo_goodput = Gauge(
            "tunerd_slo_goodput",
            "Good requests (or their output tokens, [objective] count) per second in the window",
            registry=r,
        )
        self.slo_target = Gauge(
            "tunerd_slo_target_seconds",
            "The [objective] per-request targets (NaN: not set)",
            ["target"],
            registry=r,
        )
        # Counters too, for what Prometheus does with service levels: attainment over any range, burn
        # rates (increase(good) / increase(requests)), independent of tunerd's own window.
        self.slo_requests = Counter(
            "tunerd_slo_requests",
            "Requests the door answered (or failed) and judged against the [objective] targets in force",
            registry=r,
        )
        self.slo_good = Counter(
            "tunerd_slo_good_requests",
            "Of tunerd_slo_requests_total, those that met every [objective] target in force",
            registry=r,
        )
        self._slo_counted = (0, 0)
        self.slo_attainment_objective = Gauge(
            "tunerd_slo_attainment_objective_ratio",
            "The attainment a configuration must reach to be feasible ([objective] attainment)",
            registry=r,
        )
        self.reload_ok.set(1)
        self._signal_gauges: dict[str, Gauge] = {}
        self._params_seen: set[str] = set()

    def set_engine(self, state: EngineState) -> None:
        self.engine_state.set(state.value)
        self.engine_up.set(1 if state is EngineState.RUNNING else 0)

    def set_params(self, params: Mapping[str, Any]) -> None:
        for name in self._params_seen - set(params):
            self.param.remove(name)
        for name, value in params.items():
            if isinstance(value, (int, float)):
                self.param.labels(name=name).set(float(value))
        self._params_seen = {n for n, v in params.items() if isinstance(v, (int, float))}

    def set_slo(self, stats: SloStats, targets: Targets, attainment: float) -> None:
        """The tunerd_slo_* gauges from one window's statistics; unknown is NaN, never 0."""
        nan = float("nan")
        measured = stats.requests > 0

        def value(x: float | None) -> float:
            return nan if x is None or not measured else x

        self.slo_attainment.set(value(stats.attainment))
        self.slo_goodput.set(value(stats.goodput))
        for name, share, target in (
            ("ttft", stats.attainment_ttft, targets.ttft_s),
            ("tpot", stats.attainment_tpot, targets.tpot_s),
            ("e2e", stats.attainment_e2e, targets.e2e_s),
        ):
            self.slo_target_attainment.labels(target=name).set(value(share))
            self.slo_target.labels(target=name).set(nan if target is None else target)
        self.slo_attainment_objective.set(attainment)
        counted, good = stats.requests_total, stats.good_total
        before, before_good = self._slo_counted
        if counted < before:  # a new window (its counters start at 0): everything it holds is new
            before = before_good = 0
        self.slo_requests.inc(counted - before)
        self.slo_good.inc(max(0, good - before_good))
        self._slo_counted = (counted, good)

    def set_signals(self, values: Mapping[str, float | None], units: Mapping[str, str]) -> None:
        """One gauge per signal; a signal without a value is NaN (unknown), never 0."""
        for name, value in values.items():
            gauge = self._signal_gauges.get(name)
            if gauge is None:
                metric = signal_metric_name(name, units.get(name, ""))
                gauge = Gauge(metric, f"tunerd signal {name} ({units.get(name, '')})", registry=self.registry)
                self._signal_gauges[name] = gauge
            gauge.set(float("nan") if value is None else value)
