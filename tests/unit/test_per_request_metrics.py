"""vLLM's per-request metrics (issue 21 item 2): `--enable-per-request-metrics` where this vLLM's --help
lists it and the door is on, never with `--disable-log-stats`; the door's meter reads the answer's
`metrics` object into the request sample (queue, prefill, decode) and the `door.queue.p95` /
`door.prefill.p95` signals. Answer shapes as vllm-facts.md describes them ("Newer vLLM"): the object
is on a non-streamed answer and on a stream's final usage chunk only."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.fakes import make_rig
from tunerd.config import Config
from tunerd.core.slo import RequestSample, Targets, readings, window_stats
from tunerd.door.meter import Meter, vllm_split
from tunerd.engine.launch import PER_REQUEST_METRICS_FLAG, per_request_metrics_args
from tunerd.observe.identity import flags_in_help
from tunerd.records.state import DaemonState

COMMAND = ["vllm", "serve"]
CAPS = {"command": COMMAND, "shutdown_timeout": True, "flags": [PER_REQUEST_METRICS_FLAG]}
METRICS = (
    b'"metrics":{"queue_time_ms":12.5,"time_to_first_token_ms":40.0,"generation_time_ms":940.0,'
    b'"mean_itl_ms":10.0,"tokens_per_second":98.2}'
)

# -- the capability probe ----------------------------------------------------------------------------------


def test_the_help_text_names_the_optional_flags_it_has() -> None:
    text = (
        "  --enable-per-request-metrics, --no-enable-per-request-metrics\n"
        "  --custom-histogram-buckets CUSTOM_HISTOGRAM_BUCKETS\n"
        "  --shutdown-timeout SHUTDOWN_TIMEOUT\n"
    )
    assert flags_in_help(text) == {
        "--enable-per-request-metrics",
        "--custom-histogram-buckets",
        "--shutdown-timeout",
    }


def test_a_longer_flag_is_not_a_shorter_ones_mention() -> None:
    assert flags_in_help("  --enable-per-request-metrics-extra X\n  --shutdown-timeout_s\n") == frozenset()
    assert flags_in_help("usage: vllm serve [options]\n") == frozenset()


# -- the command line --------------------------------------------------------------------------------------


def config(door: bool = True, **engine: object) -> Config:
    return Config.model_validate(
        {"engine": {"model": "/m", "port": 18000, **engine}, "door": {"enabled": door, "port": 8000}}
    )


def test_the_flag_is_passed_with_the_door_where_this_vllm_has_it() -> None:
    assert per_request_metrics_args(config(), CAPS) == [PER_REQUEST_METRICS_FLAG]


@pytest.mark.parametrize(
    ("cfg", "caps"),
    [
        (config(door=False), CAPS),  # nothing reads the metrics without the door
        (config(per_request_metrics="off"), CAPS),  # the operator turned it off
        (config(), {**CAPS, "flags": []}),  # this vLLM's --help does not list it (0.24)
        (config(), {**CAPS, "command": ["python", "-m", "vllm.entrypoints.openai.api_server"]}),  # not asked
        (config(extra_args=["--disable-log-stats"]), CAPS),  # vLLM refuses the two together
        (config(extra_args=["--disable_log_stats"]), CAPS),
        (config(extra_args=["--enable-per-request-metrics"]), CAPS),  # already said
    ],
)
def test_the_flag_is_left_out(cfg: Config, caps: dict[str, object]) -> None:
    assert per_request_metrics_args(cfg, caps) == []


def test_a_bad_value_of_the_key_is_refused() -> None:
    with pytest.raises(ValueError, match="per_request_metrics"):
        config(per_request_metrics="on")


def test_the_started_command_line_carries_the_flag(tmp_path: Path) -> None:
    rig = make_rig(
        tmp_path,
        {"door": {"enabled": True, "port": 18999}},
        dstate=DaemonState(capabilities=dict(CAPS)),
    )
    rig.start()
    assert PER_REQUEST_METRICS_FLAG in rig.os.spawns[-1].argv


# -- the meter ---------------------------------------------------------------------------------------------


def test_a_non_streamed_answers_metrics_split_the_upstream_time() -> None:
    body = b'{"choices":[{"text":"y"}],"usage":{"completion_tokens":95},' + METRICS + b"}"
    queue, prefill, decode = vllm_split(body, 95)  # type: ignore[misc]
    assert queue == pytest.approx(0.0125) and prefill == pytest.approx(0.040)
    assert decode == pytest.approx(0.010 * 94)  # mean ITL × (tokens − 1)


def test_no_metrics_object_or_too_few_tokens_leave_the_split_unknown() -> None:
    assert vllm_split(b'{"usage":{"completion_tokens":3}}', 3) is None
    queue, _, decode = vllm_split(b"{" + METRICS + b"}", 1)  # type: ignore[misc]
    assert decode is None and queue == pytest.approx(0.0125)
    assert vllm_split(b"{" + METRICS + b"}", None)[2] is None  # type: ignore[index]


def test_a_key_of_a_later_object_is_not_read_as_vllms() -> None:
    text = b'{"metrics":{"queue_time_ms":1.0},"other":{"time_to_first_token_ms":5.0}}'
    assert vllm_split(text, 2) == (pytest.approx(0.001), None, None)


def test_the_final_usage_chunk_of_a_stream_fills_the_sample() -> None:
    m = Meter()
    m.sse, m.first, m.last, m.events = True, 100.3, 101.2, 12
    m.prev = b'data: {"choices":[{"text":"z"}]}\n\n'
    m.tail = (
        b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":10},'
        + METRICS
        + b"}\n\ndata: [DONE]\n\n"
    )
    s = m.sample(100.0, 101.25)
    assert s.tokens == 10 and s.tokens_exact
    assert (s.queue_s, s.prefill_s) == (pytest.approx(0.0125), pytest.approx(0.040))
    assert s.decode_s == pytest.approx(0.090)


def test_a_stream_without_usage_has_no_split() -> None:
    m = Meter()
    m.sse, m.first, m.last, m.events, m.tail = True, 100.1, 100.5, 5, b"data: [DONE]\n\n"
    s = m.sample(100.0, 100.5)
    assert (s.queue_s, s.prefill_s, s.decode_s) == (None, None, None)


# -- the signals -------------------------------------------------------------------------------------------


def _sample(queue: float | None, prefill: float | None) -> RequestSample:
    return RequestSample(10.0, 0.0, 0.1, 0.1, 10, True, 0.01, 0.2, True, True, queue, prefill, 0.09)


def test_vllms_queue_and_prefill_percentiles_are_over_the_requests_that_carried_them() -> None:
    samples = [_sample(0.010 * i, 0.020) for i in range(1, 21)] + [_sample(None, None)] * 5
    stats = window_stats(samples, Targets(ttft_s=1.0), "requests", span_s=60.0)
    r = readings(stats, door_waiting=0)
    assert r["door.queue.p95"] == pytest.approx(0.1905)  # 20 values 0.01..0.20, linear between ranks
    assert r["door.prefill.p95"] == pytest.approx(0.020)


def test_without_per_request_metrics_the_split_signals_are_unknown() -> None:
    stats = window_stats([_sample(None, None)], Targets(ttft_s=1.0), "requests", span_s=60.0)
    r = readings(stats, door_waiting=0)
    assert r["door.queue.p95"] is None and r["door.prefill.p95"] is None
