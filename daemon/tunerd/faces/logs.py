"""structlog set-up: JSON lines when stderr is not a terminal (journald, files), readable on a terminal.

When stderr is the journal (systemd's `JOURNAL_STREAM` names it), every line starts with the `<N>` of
sd-daemon(3), N the syslog priority of its level, so that `journalctl -u tunerd -p err` shows tunerd's
errors; journald strips the prefix. Any other sink gets the lines unprefixed. The same holds for the
plain `file: key: reason` lines of a config error (`print_error_lines`), printed before logging is set up.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO, Any

import structlog

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

# syslog(3) priorities by structlog level name (add_log_level names `exception` "error", `warn` "warning").
SYSLOG_PRIORITIES = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "critical": 2, "fatal": 2}
DEFAULT_PRIORITY = 6  # journald's own default for a stream line (info)


def stderr_is_journal(stream: IO[Any] | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether `stream` (default stderr) is the journal stream systemd connected: `JOURNAL_STREAM` is
    `<device>:<inode>` of it (systemd.exec(5)); a redirected stderr no longer matches."""
    value = (os.environ if environ is None else environ).get("JOURNAL_STREAM", "")
    device, sep, inode = value.partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        st = os.fstat((sys.stderr if stream is None else stream).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return st.st_dev == int(device) and st.st_ino == int(inode)


def print_error_lines(text: str, stream: IO[str] | None = None) -> None:
    """Print an operator-facing error (`file: key: reason`, one or more lines) to `stream` (default: stderr
    now). On the journal stream each line starts with `<3>`, so journald files it at priority err and
    `journalctl -u tunerd -p err` shows why the unit failed, not only systemd's "Failed to start" (without
    the prefix a stream line is info). Any other sink (a terminal, a file) gets the lines as they are."""
    out = sys.stderr if stream is None else stream
    prefix = f"<{SYSLOG_PRIORITIES['error']}>" if stderr_is_journal(out) else ""
    for line in text.splitlines() or [""]:
        print(prefix + line, file=out)


class JournalPriorityPrefix:
    """Wraps the final renderer: `<N>` + the rendered line, N the syslog priority of the record's level."""

    def __init__(self, renderer: structlog.types.Processor) -> None:
        self.renderer = renderer

    def __call__(self, logger: Any, method_name: str, event_dict: Any) -> str:
        level = str(event_dict.get("level", method_name)).lower()
        priority = SYSLOG_PRIORITIES.get(level, DEFAULT_PRIORITY)
        return f"<{priority}>{self.renderer(logger, method_name, event_dict)}"


def configure_logging(level: str = "info", fmt: str = "auto", stream: IO[str] | None = None) -> None:
    """Configure structlog for the process. `fmt`: auto | json | console. Safe to call again (reload).
    `stream`: where the lines go (default: stderr)."""
    out = sys.stderr if stream is None else stream
    console = out.isatty() if fmt == "auto" else fmt == "console"
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=out.isatty()) if console else structlog.processors.JSONRenderer()
    )
    if stderr_is_journal(out):
        renderer = JournalPriorityPrefix(renderer)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )
