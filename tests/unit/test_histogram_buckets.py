"""`--custom-histogram-buckets` at the `[objective]` targets (issue 21 item 2): vLLM's default edges plus
the target and a few around it, where this vLLM's --help lists the flag; a value vLLM refuses at
parsing drops the flag for this command. The JSON form (family → edges) is vllm-facts.md's reading of
the vLLM source: no captured --help shows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.fakes import make_rig
from tunerd.config import Config
from tunerd.core.failures import EngineFailure, FailureKind
from tunerd.core.params import EngineParams
from tunerd.core.slo import Targets
from tunerd.core.slo_estimate import DEFAULT_BUCKETS, share_within, target_buckets
from tunerd.engine.launch import HISTOGRAM_BUCKETS_FLAG, histogram_buckets_args
from tunerd.policy.corrections import correction
from tunerd.records.state import DaemonState

COMMAND = ["vllm", "serve"]
CAPS = {"command": COMMAND, "shutdown_timeout": True, "flags": [HISTOGRAM_BUCKETS_FLAG]}


def test_the_buckets_keep_vllms_defaults_and_add_the_target_and_its_neighbours() -> None:
    buckets = target_buckets(Targets(ttft_s=1.2, tpot_s=0.004))
    assert set(buckets) == {"time_to_first_token", "inter_token_latency"}
    ttft = buckets["time_to_first_token"]
    assert set(DEFAULT_BUCKETS["time_to_first_token"]) <= set(ttft)
    assert 1.2 in ttft and 0.96 in ttft and 1.5 in ttft and 2.4 in ttft  # 0.8×, 1.25×, 2×
    assert ttft == sorted(ttft) and len(ttft) == len(set(ttft))
    itl = buckets["inter_token_latency"]
    assert 0.004 in itl and 0.001 in itl  # below vLLM's first 10 ms edge, where itl.p95 was blind


def test_an_e2e_target_changes_the_request_latency_family_and_no_target_changes_nothing() -> None:
    assert list(target_buckets(Targets(e2e_s=3.0))) == ["request_latency"]
    assert 3.0 in target_buckets(Targets(e2e_s=3.0))["request_latency"]
    assert target_buckets(Targets()) == {}


def test_at_the_targets_edge_the_share_within_it_is_exact() -> None:
    # The case: a 1.26 s TTFT target fell between the 1.0 and 2.5 s edges; with an edge at it the
    # share is one figure, not an interval.
    edges = (*target_buckets(Targets(ttft_s=1.26))["time_to_first_token"], float("inf"))
    cumulative = tuple(float(sum(1 for v in (0.5, 1.1, 1.26, 1.3, 3.0) if v <= e)) for e in edges)
    share = share_within(edges, cumulative, 1.26)
    assert share is not None and share.exact and share.low == pytest.approx(3 / 5)


def config(**engine: object) -> Config:
    return Config.model_validate(
        {
            "engine": {"model": "/m", "port": 18000, **engine},
            "objective": {"kind": "goodput", "ttft_s": 1.0, "tpot_s": 0.05},
        }
    )


def test_the_flag_carries_one_json_object_of_family_edges() -> None:
    args = histogram_buckets_args(config(), CAPS)
    assert args[0] == HISTOGRAM_BUCKETS_FLAG
    assert json.loads(args[1]) == target_buckets(Targets(ttft_s=1.0, tpot_s=0.05))


@pytest.mark.parametrize(
    ("cfg", "caps"),
    [
        (config(histogram_buckets="off"), CAPS),
        (config(), {**CAPS, "flags": []}),  # this vLLM does not list it
        (config(), {**CAPS, "command": ["other"]}),  # --help of another command
        (config(extra_args=["--custom-histogram-buckets", "{}"]), CAPS),  # the operator's own
        (Config.model_validate({"engine": {"model": "/m"}}), CAPS),  # no target
    ],
)
def test_the_flag_is_left_out(cfg: Config, caps: dict[str, object]) -> None:
    assert histogram_buckets_args(cfg, caps) == []


def test_the_started_command_line_carries_the_buckets(tmp_path: Path) -> None:
    rig = make_rig(
        tmp_path,
        {"objective": {"ttft_s": 2.0}},
        dstate=DaemonState(capabilities=dict(CAPS)),
    )
    rig.start()
    argv = rig.os.spawns[-1].argv
    value = json.loads(argv[argv.index(HISTOGRAM_BUCKETS_FLAG) + 1])
    assert 2.0 in value["time_to_first_token"]


def test_a_value_vllm_refuses_at_parsing_drops_the_flag_once() -> None:
    detail = "api_server.py: error: argument --custom-histogram-buckets: invalid loads value: '{...}'"
    fix = correction(EngineFailure(FailureKind.BAD_ARGUMENTS, detail), EngineParams(), None, "cuda")
    assert fix is not None and fix.drop_flags == (HISTOGRAM_BUCKETS_FLAG,)
    assert fix.params == EngineParams()


def test_a_bad_value_of_an_operators_flag_is_not_dropped() -> None:
    detail = "api_server.py: error: argument --max-loras: invalid int value: 'x'"
    assert correction(EngineFailure(FailureKind.BAD_ARGUMENTS, detail), EngineParams(), None, "cuda") is None
