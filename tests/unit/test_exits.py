"""Decoding how the engine's main process ended."""

from __future__ import annotations

import os
import signal

import pytest

from tunerd.core.exits import ExitStatus


def exited(code: int) -> int:
    """The raw wait status of a process that called exit(code)."""
    return code << 8


def killed(sig: int, *, core: bool = False) -> int:
    """The raw wait status of a process killed by `sig` (optionally with a core dump)."""
    return sig | (0x80 if core else 0)


@pytest.mark.parametrize("code", [0, 1, 2, 78, 255])
def test_wait_status_of_an_exit_gives_the_code(code: int) -> None:
    assert os.waitstatus_to_exitcode(exited(code)) == code  # the helper builds real statuses
    assert ExitStatus.from_wait_status(exited(code)) == ExitStatus(code=code, signal=None)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGSEGV, signal.SIGILL])
def test_wait_status_of_a_signal_gives_the_signal(sig: signal.Signals) -> None:
    assert os.waitstatus_to_exitcode(killed(sig)) == -sig
    assert ExitStatus.from_wait_status(killed(sig)) == ExitStatus(code=None, signal=int(sig))


def test_wait_status_with_core_dump_still_gives_the_signal() -> None:
    assert ExitStatus.from_wait_status(killed(signal.SIGSEGV, core=True)).signal == signal.SIGSEGV


def test_only_sigkill_is_a_likely_oom_kill() -> None:
    assert ExitStatus(code=None, signal=signal.SIGKILL).likely_oom_kill
    assert not ExitStatus(code=None, signal=signal.SIGTERM).likely_oom_kill
    assert not ExitStatus(code=None, signal=signal.SIGSEGV).likely_oom_kill
    assert not ExitStatus(code=137, signal=None).likely_oom_kill  # a shell's 128+9 is an exit code
    assert not ExitStatus(code=0, signal=None).likely_oom_kill


def test_describe_exit_code() -> None:
    assert ExitStatus(code=1, signal=None).describe() == "exited with code 1"
    assert ExitStatus(code=0, signal=None).describe() == "exited with code 0"


def test_describe_sigkill_mentions_likely_oom_kill() -> None:
    assert ExitStatus(code=None, signal=9).describe() == "killed by SIGKILL (likely OOM kill)"


def test_describe_sigkill_sent_by_us_drops_the_oom_hint() -> None:
    assert ExitStatus(code=None, signal=9).describe(killed_by_us=True) == "killed by SIGKILL"


def test_describe_other_signal_has_no_oom_hint() -> None:
    assert ExitStatus(code=None, signal=signal.SIGILL).describe() == "killed by SIGILL"
    assert ExitStatus(code=None, signal=signal.SIGTERM).describe() == "killed by SIGTERM"


def test_unknown_signal_number_is_named_by_number() -> None:
    status = ExitStatus(code=None, signal=200)
    assert status.signal_name == "signal 200"
    assert status.describe() == "killed by signal 200"


def test_as_dict_names_the_signal() -> None:
    assert ExitStatus(code=None, signal=9).as_dict() == {"code": None, "signal": "SIGKILL"}
    assert ExitStatus(code=2, signal=None).as_dict() == {"code": 2, "signal": None}


def test_wait_status_round_trip_through_describe() -> None:
    assert ExitStatus.from_wait_status(killed(signal.SIGKILL)).describe() == (
        "killed by SIGKILL (likely OOM kill)"
    )
    assert ExitStatus.from_wait_status(exited(1)).describe() == "exited with code 1"
