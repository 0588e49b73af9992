"""Log levels reach journald as priorities: `<N>` prefixes (sd-daemon(3)) when stderr is the journal stream
systemd connected ($JOURNAL_STREAM), plain JSON lines on any other sink."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest
import structlog

from tunerd.faces.logs import configure_logging, stderr_is_journal


@pytest.fixture
def stderr_file(tmp_path: Path) -> Iterator[TextIO]:
    """A real file as the daemon's stderr (journald's stream is a socket; a file has a device and an
    inode just the same)."""
    with open(tmp_path / "stderr", "w+") as stream:
        yield stream
    structlog.reset_defaults()


def stream_id(stream: TextIO) -> str:
    st = os.fstat(stream.fileno())
    return f"{st.st_dev}:{st.st_ino}"


def log_one_of_each() -> None:
    log = structlog.get_logger("tunerd")
    log.debug("a.debug")
    log.info("a.info", pid=12)
    log.warning("a.warning")
    log.error("engine.failed", kind="engine_dead")


def lines_of(stream: TextIO) -> list[str]:
    stream.flush()
    stream.seek(0)
    return stream.read().splitlines()


def test_on_the_journal_stream_each_line_carries_its_syslog_priority(
    stderr_file: TextIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(stderr_file))
    configure_logging("debug", "json", stderr_file)
    log_one_of_each()
    lines = lines_of(stderr_file)
    assert [line[:3] for line in lines] == ["<7>", "<6>", "<4>", "<3>"]
    records = [json.loads(line[3:]) for line in lines]  # the rest of the line is the same JSON
    assert [r["event"] for r in records] == ["a.debug", "a.info", "a.warning", "engine.failed"]
    assert records[3]["level"] == "error" and records[3]["kind"] == "engine_dead"


def test_the_console_format_is_prefixed_on_the_journal_too(
    stderr_file: TextIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(stderr_file))
    configure_logging("info", "console", stderr_file)
    structlog.get_logger("tunerd").error("engine.failed")
    [line] = lines_of(stderr_file)
    assert line.startswith("<3>") and "engine.failed" in line


def test_a_stderr_that_is_not_the_journal_stream_gets_plain_json(
    stderr_file: TextIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # systemd's stream is inherited, then stderr redirected elsewhere (e.g. `tunerd run 2>file`).
    with open(tmp_path / "other", "w") as other:
        monkeypatch.setenv("JOURNAL_STREAM", stream_id(other))
        configure_logging("debug", "json", stderr_file)
        log_one_of_each()
    lines = lines_of(stderr_file)
    assert len(lines) == 4
    assert [json.loads(line)["level"] for line in lines] == ["debug", "info", "warning", "error"]


def test_without_journal_stream_the_lines_are_plain_json(
    stderr_file: TextIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    configure_logging("info", "json", stderr_file)
    structlog.get_logger("tunerd").error("engine.failed")
    [line] = lines_of(stderr_file)
    assert json.loads(line)["event"] == "engine.failed"


@pytest.mark.parametrize("value", ["", "garbage", "12:", ":34", "1:2:3", "x:y"])
def test_a_malformed_journal_stream_is_not_the_journal(stderr_file: TextIO, value: str) -> None:
    assert not stderr_is_journal(stderr_file, {"JOURNAL_STREAM": value})


def test_the_journal_stream_is_recognised_by_device_and_inode(stderr_file: TextIO) -> None:
    assert stderr_is_journal(stderr_file, {"JOURNAL_STREAM": stream_id(stderr_file)})


# A config error is printed before logging is set up, as plain `file: key: reason` lines. Under systemd
# (Debian 12, nspawn) they reached journald at info: `journalctl -u tunerd -p err` showed only systemd's
# "Failed to start". On the journal stream they carry `<3>` too.

BAD_KEY = '[engine]\nmodel = "/m"\n[timeouts]\ngraceful_stop_sec = 1.0\n'


def run_cli(argv: list[str], stderr: TextIO, monkeypatch: pytest.MonkeyPatch) -> int:
    from tunerd.cli.main import main

    monkeypatch.setattr(sys, "stderr", stderr)
    return main(argv)


@pytest.mark.parametrize("argv", [["run", "--config"], ["check-config"]], ids=["run", "check-config"])
def test_a_config_errors_lines_reach_the_journal_at_err(
    argv: list[str], stderr_file: TextIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `tunerd run` at the unit's start; `tunerd check-config`, the ExecReload= that fails a bad reload.
    config = tmp_path / "tunerd.toml"
    config.write_text(BAD_KEY)
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(stderr_file))
    assert run_cli([*argv, str(config)], stderr_file, monkeypatch) == (78 if argv[0] == "run" else 1)
    lines = lines_of(stderr_file)
    assert lines and all(line.startswith("<3>") for line in lines), lines
    assert f"<3>{config}: timeouts.graceful_stop_sec: unknown key" in lines


def test_a_config_error_on_a_terminal_or_file_is_printed_as_it_is(
    stderr_file: TextIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "tunerd.toml"
    config.write_text(BAD_KEY)
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    assert run_cli(["run", "--config", str(config)], stderr_file, monkeypatch) == 78
    assert lines_of(stderr_file) == [f"{config}: timeouts.graceful_stop_sec: unknown key"]


def test_a_setup_error_at_start_reaches_the_journal_at_err(
    stderr_file: TextIO, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tunerd.supervisor

    class Refusing:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

        def setup(self) -> None:
            raise tunerd.supervisor.DaemonSetupError("paths: cannot use the state dir or journal: denied")

    config = tmp_path / "tunerd.toml"
    config.write_text('[engine]\nmodel = "/m"\n')
    monkeypatch.setattr(tunerd.supervisor, "Supervisor", Refusing)
    monkeypatch.setenv("JOURNAL_STREAM", stream_id(stderr_file))
    assert run_cli(["run", "--config", str(config)], stderr_file, monkeypatch) == 78
    assert lines_of(stderr_file) == [f"<3>{config}: paths: cannot use the state dir or journal: denied"]
