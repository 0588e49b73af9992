"""The door's Prometheus families, registered in the registry the daemon passes in (served with its own).

`tunerd_door_requests_total{outcome}` counts events, not exclusive fates: one request may count in
several (held, then released; forwarded, cut, replayed — see docs/door.md for each outcome).
"""

from __future__ import annotations

from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

Outcome = Literal[
    "forwarded",
    "held",
    "released",
    "replayed",
    "rejected_queue_full",
    "rejected_too_long",
    "rejected_too_large",
    "rejected_hold_timeout",
    "rejected_fatal",
    "drain_cut",
    "stream_cut",
    "upstream_error",
    "client_gone",
]
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)

# Seconds. Added latency is sub-millisecond when nothing waits; hold time spans a restart (minutes).
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1, 1.0, 10.0, 60.0)
HOLD_BUCKETS = (0.001, 0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class DoorMetrics:
    """tunerd_door_* in `registry`. Touched only in the door's thread (prometheus_client is thread-safe
    anyway, so the daemon's HTTP face may serve them at any time)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "tunerd_door_requests",
            "Requests through the front door, by outcome (events: one request may count in several)",
            ["outcome"],
            registry=registry,
        )
        # Every series exists from the start (a rate over a missing one is empty); children looked up once.
        self._outcomes = {outcome: self.requests.labels(outcome=outcome) for outcome in OUTCOMES}
        self.in_flight = Gauge(
            "tunerd_door_in_flight",
            "Requests forwarded to vLLM and not yet answered in full",
            registry=registry,
        )
        self.queued = Gauge("tunerd_door_queue_length", "Requests waiting in the door", registry=registry)
        self.max_in_flight = Gauge(
            "tunerd_door_max_in_flight", "The door's in-flight cap (0: none)", registry=registry
        )
        self.limit_changes = Counter(
            "tunerd_door_max_in_flight_changes",
            "Changes of the door's in-flight cap, by who changed it (steered: the door's controller; "
            "set: the operator, the config)",
            ["by"],
            registry=registry,
        )
        for by in ("steered", "set"):
            self.limit_changes.labels(by=by)
        self.hold = Histogram(
            "tunerd_door_hold_seconds",
            "Time a request waited in the door before it was forwarded (or refused)",
            buckets=HOLD_BUCKETS,
            registry=registry,
        )
        self.added = Histogram(
            "tunerd_door_added_latency_seconds",
            "Arrival to first byte sent to the client, minus vLLM's own time to first byte",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )

    def count(self, outcome: Outcome, n: int = 1) -> None:
        if n:
            self._outcomes[outcome].inc(n)
