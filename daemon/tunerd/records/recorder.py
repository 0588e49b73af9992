"""Writes the journal for the main loop, and keeps going when the disk does not.

A record that cannot be made durable is logged and counted (`tunerd_journal_write_errors_total`); the
error stays visible in status. Callers that announce a change check `intent()`'s None: no change is
applied without a durable intent (reliability.md, "disk full").
"""

from __future__ import annotations

from typing import Any

import structlog

from tunerd.records.journal import Journal, JournalError
from tunerd.records.metrics import Metrics

log = structlog.get_logger("tunerd")


class Recorder:
    def __init__(self, journal: Journal, metrics: Metrics) -> None:
        self.journal = journal
        self.metrics = metrics
        self.error: str | None = None  # the last write failure, until a write succeeds again

    def record(self, event: str, **fields: Any) -> int | None:
        """Append a record; returns its seq, or None when it could not be written."""
        try:
            seq = self.journal.append(event, **fields)
        except JournalError as exc:
            self._failed(event, exc)
            return None
        self.error = None
        return seq

    def intent(self, action: str, **fields: Any) -> int | None:
        """Announce an action; None means it is not durable and a change must not be applied."""
        try:
            seq = self.journal.intent(action, **fields)
        except JournalError as exc:
            self._failed("intent", exc)
            return None
        self.error = None
        return seq

    def outcome(self, intent: int | None, result: str, **fields: Any) -> None:
        if intent is None:
            return
        try:
            self.journal.outcome(intent, result, **fields)
        except JournalError as exc:
            self._failed("outcome", exc)

    @property
    def last_record(self) -> dict[str, Any] | None:
        return self.journal.last_record

    def _failed(self, event: str, exc: JournalError) -> None:
        self.error = str(exc)
        self.metrics.journal_errors.inc()
        log.error("journal.write_failed", event_name=event, error=str(exc))
