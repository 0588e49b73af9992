"""Scrape vLLM's `/metrics` and extract the few families tunerd uses.

The poller asks vLLM for only the samples read here (`filtered_metrics_url`: vLLM's prometheus_client
endpoint then renders just those, a small part of the whole page), and `extract` reads the answer with
prometheus_client's own parser (`text_string_to_metric_families`) and aggregates the samples over
series. Asking for less is what keeps the once-a-second poll cheap; bench/poll_cost.py measures it.

`extract` raises `MetricsParseError` (a ValueError) wherever the parser raises ValueError, so that
garbage (HTML error pages, JSON, plain-text errors, binary junk, a corrupt line) is never read as a
sample. It is stricter where a body was evidently cut: text that does not end with a newline (the format
requires one; a body cut mid-line can otherwise end in a plausible wrong value such as "9." for "9.0"),
and a histogram read here without its `+Inf` bucket, `_count` or `_sum`.
"""

from __future__ import annotations

import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tunerd.core.engine_sample import EngineSample, Histogram

__all__ = [
    "DEFAULT_TIMEOUT",
    "EngineSample",
    "Histogram",
    "MetricsParseError",
    "SameBodySameSample",
    "ScrapeResult",
    "extract",
    "filtered_metrics_url",
    "scrape",
]

# Connect fast (vLLM is local), but give a busy API server's event loop time to answer.
DEFAULT_TIMEOUT = httpx.Timeout(2.0, connect=0.5)
# The text format, not OpenMetrics; identity encoding: gzip on localhost only costs CPU on both sides.
_HEADERS = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "Accept-Encoding": "identity"}


class MetricsParseError(ValueError):
    """The text is not Prometheus text exposition, or is truncated; the message says why."""


@dataclass(frozen=True, slots=True)
class ScrapeResult:
    """One scrape: `sample` is None exactly when `error` says why (timeout, HTTP status, connection,
    oversized or unparsable body). `seconds` is the wall time of the whole scrape, `body_bytes` the
    bytes read (up to the point it stopped)."""

    sample: EngineSample | None
    error: str | None
    seconds: float
    body_bytes: int


# Sample names read, per EngineSample field, in order of preference: vLLM renamed some families
# (gpu_cache_usage_perc removed late 2025; gpu_prefix_cache_* in early V1; time_per_output_token).
_SCALARS: dict[str, tuple[str, ...]] = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "requests_running": ("vllm:num_requests_running",),
    "requests_waiting": ("vllm:num_requests_waiting",),
    "preemptions_total": ("vllm:num_preemptions_total",),
    "prompt_tokens_total": ("vllm:prompt_tokens_total",),
    "generation_tokens_total": ("vllm:generation_tokens_total",),
    "prefix_cache_queries_total": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits_total": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
}
_HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "request_tpot": ("vllm:request_time_per_output_token_seconds",),  # core/slo_estimate.py
    # Observed once per finished request: the sizes of the requests a window finished (policy/evidence.py).
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
}
_CACHE_CONFIG = "vllm:cache_config_info"
_HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")
# Every sample name `extract` reads, and so asks vLLM for; the other samples of a body are only parsed.
_NAMES = [name for names in _SCALARS.values() for name in names] + [
    base + suffix for bases in _HISTOGRAMS.values() for base in bases for suffix in _HISTOGRAM_SUFFIXES
]
_WANTED = frozenset([*_NAMES, _CACHE_CONFIG])
_FILTER_QUERY_NO_INFO = urllib.parse.urlencode([("name[]", name) for name in _NAMES])
_FILTER_QUERY = urllib.parse.urlencode([("name[]", name) for name in [*_NAMES, _CACHE_CONFIG]])
_MAX_SCALARS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})


def extract(text: str, *, cache_config: Mapping[str, str] | None = None) -> EngineSample:
    """Read the families of `EngineSample` from Prometheus text `text` (the whole /metrics page or the
    filtered answer).

    Every line is parsed by prometheus_client's parser; the samples of the families read here are then
    aggregated over series (see `EngineSample`). When two names of one field are present (vLLM renamed
    some families), the current name wins. A family absent from the text is None (the empty text gives
    an all-None sample), except that `cache_config` is returned as the sample's `cache_config` when the
    text has no `vllm:cache_config_info` series: for a caller that asks for that static series once per
    run. Raises MetricsParseError for text the parser rejects, text not ending with a newline, and a
    histogram without its `+Inf` bucket, `_count` or `_sum`. No side effects.
    """
    if text and text[-1] != "\n":
        raise MetricsParseError(f"truncated body: no newline at the end ({text[-40:]!r})")
    found: dict[str, list[Sample]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _WANTED:
                    found.setdefault(sample.name, []).append(sample)
    except ValueError as exc:
        reason = str(exc)[:120] or "a line the parser rejects"
        raise MetricsParseError(f"not Prometheus text exposition: {reason}") from exc
    fields: dict[str, object] = {}
    for field, alternatives in _SCALARS.items():
        name = next((n for n in alternatives if n in found), None)
        if name is not None:
            values = [float(s.value) for s in found[name]]
            fields[field] = max(values) if name in _MAX_SCALARS else sum(values)
    for field, bases in _HISTOGRAMS.items():
        base = next((b for b in bases if any(b + suffix in found for suffix in _HISTOGRAM_SUFFIXES)), None)
        if base is not None:
            fields[field] = _histogram(base, found)
    info = found.get(_CACHE_CONFIG)
    fields["cache_config"] = MappingProxyType(dict(info[0].labels)) if info else cache_config
    return EngineSample(**fields)  # type: ignore[arg-type]


class SameBodySameSample:
    """`extract` that answers its last text again without parsing it.

    An idle vLLM answers the filtered /metrics with the same bytes every second (its counters, gauges
    and histograms stand still; bench/poll_cost.py checks it on real vLLM), and parsing them is most of
    the idle daemon's poll (about 3 of its 4 ms on the 2-core box: docs/benchmarks-notes.md). `extract`
    is a pure function of the text and `cache_config`, so the same text with the same `cache_config`
    object gets the same (immutable) sample. Holds one text; one per poller (not thread-safe).
    """

    def __init__(self) -> None:
        self._last: tuple[str, Mapping[str, str] | None, EngineSample] | None = None

    def __call__(self, text: str, *, cache_config: Mapping[str, str] | None = None) -> EngineSample:
        last = self._last
        if last is not None and last[0] == text and last[1] is cache_config:
            return last[2]
        sample = extract(text, cache_config=cache_config)  # raises as extract does; nothing is kept then
        self._last = (text, cache_config, sample)
        return sample


def _histogram(base: str, found: Mapping[str, list[Sample]]) -> Histogram:
    """The histogram `base` summed over its series; raises MetricsParseError if a part is missing."""
    buckets: dict[float, float] = {}
    for sample in found.get(base + "_bucket", ()):
        le = sample.labels.get("le")
        try:
            bound = float(le)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise MetricsParseError(f"{base}_bucket series with le={le!r}") from None
        buckets[bound] = buckets.get(bound, 0.0) + float(sample.value)
    count, total = found.get(base + "_count"), found.get(base + "_sum")
    if float("inf") not in buckets or count is None or total is None:
        raise MetricsParseError(f"histogram {base} lacks its +Inf bucket, _count or _sum (truncated body?)")
    return Histogram(
        tuple(sorted(buckets.items())),
        sum(float(s.value) for s in count),
        sum(float(s.value) for s in total),
    )


def filtered_metrics_url(base_url: str, *, cache_config: bool = True) -> str:
    """`<base>/metrics/?name[]=…` asking for only the samples `extract` reads.

    vLLM serves /metrics with prometheus_client's `make_asgi_app`, which renders only the named samples
    when given `name[]` parameters: a fraction of the page, cheaper to render for vLLM and to parse for
    us. The trailing slash matters: vLLM's route for `/metrics` (a regex workaround for a 307 redirect,
    vllm/entrypoints/serve/instrumentator/metrics.py) drops the query string without it. Names a
    version does not have are ignored by the server, so old and new names are all asked for.
    `cache_config=False` leaves out `vllm:cache_config_info`: static for a run, and with its ~40 labels
    a large share of the filtered answer.
    """
    return f"{base_url}/metrics/?{_FILTER_QUERY if cache_config else _FILTER_QUERY_NO_INFO}"


def _total_budget(timeout: httpx.Timeout) -> float | None:
    # httpx's read timeout is per chunk: a server dripping bytes could hold a poll forever.
    if timeout.connect is None or timeout.read is None:
        return None
    return timeout.connect + 2 * timeout.read


def scrape(
    client: httpx.Client,
    url: str | httpx.URL,
    *,
    max_bytes: int = 4 << 20,
    timeout: httpx.Timeout | None = None,
    cache_config: Mapping[str, str] | None = None,
    parse: Callable[..., EngineSample] = extract,
) -> ScrapeResult:
    """GET `url` (vLLM's `/metrics`, whole or filtered) and extract an `EngineSample`.

    `cache_config` is passed to `parse`: `extract`, or a `SameBodySameSample` kept between scrapes by a
    caller that scrapes one server again and again. Never raises for network, HTTP or parse problems: those
    return `ScrapeResult(sample=None, error=reason)` — a missing sample, never zeros. The body is
    streamed and abandoned once it exceeds `max_bytes` (or its Content-Length announces more).
    `timeout` defaults to `DEFAULT_TIMEOUT`; the whole scrape is also bounded by connect + 2 × read
    seconds. Side effect: one HTTP request (on `client`'s keep-alive connection when it has one).
    """
    timeout = timeout or DEFAULT_TIMEOUT
    budget = _total_budget(timeout)
    started = time.perf_counter()
    received = 0

    def failed(reason: str) -> ScrapeResult:
        return ScrapeResult(None, reason, time.perf_counter() - started, received)

    try:
        with client.stream("GET", url, headers=_HEADERS, timeout=timeout) as response:
            if response.status_code != 200:
                return failed(f"HTTP {response.status_code}")
            announced = response.headers.get("content-length", "")
            if announced.isdigit() and int(announced) > max_bytes:
                return failed(f"body too large: Content-Length {announced} > {max_bytes} bytes")
            chunks: list[bytes] = []
            for chunk in response.iter_bytes():
                received += len(chunk)
                if received > max_bytes:
                    return failed(f"body too large: over {max_bytes} bytes")
                if budget is not None and time.perf_counter() - started > budget:
                    return failed(f"timeout: body not complete after {budget:g} s")
                chunks.append(chunk)
    except httpx.TimeoutException as exc:
        return failed(f"timeout: {type(exc).__name__}")
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    try:
        sample = parse(b"".join(chunks).decode("utf-8"), cache_config=cache_config)
    except UnicodeDecodeError as exc:
        return failed(f"body is not UTF-8: {exc.reason} at byte {exc.start}")
    except MetricsParseError as exc:
        return failed(str(exc))
    return ScrapeResult(sample, None, time.perf_counter() - started, received)
