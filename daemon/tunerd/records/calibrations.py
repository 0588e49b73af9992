"""Planner calibrations on disk: one JSON file in the state dir, written atomically.

The file holds `{"version": 1, "entries": {key: [record, ...]}}`: per calibration key (the planner's
`calibration_key`), the records of the last starts, oldest first. What a record means and which one
applies is the planner's business (`tunerd.planner.calibration`); this module only keeps them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tunerd.records.durable import atomic_write

FILENAME = "planner-calibration.json"


class CalibrationFile:
    """`state_dir/planner-calibration.json`. A missing or damaged file reads as empty."""

    def __init__(self, state_dir: str | Path) -> None:
        self.path = Path(state_dir) / FILENAME

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            # Missing, unreadable or damaged: it must not stop the daemon (the next start recalibrates).
            return {"version": 1, "entries": {}}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            return {"version": 1, "entries": {}}
        return data

    def entries(self) -> dict[str, list[dict[str, Any]]]:
        """Every key's records, oldest first. Never raises."""
        return self._load()["entries"]

    def append(self, key: str, record: dict[str, Any], *, keep: int, now: float) -> None:
        """Add `record` under `key` (wall time `now` as `_stored_at`), keeping the last `keep` of that key;
        rewrites the file atomically (temp file, fsync, rename, fsync dir). Raises OSError."""
        data = self._load()
        records = data["entries"].setdefault(key, [])
        records.append({**record, "_stored_at": now})
        del records[: max(0, len(records) - keep)]
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
