"""Planner calibrations on disk: one JSON file in the state dir, written atomically (the I/O edge of
`tunerd.decide.calibration`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from tunerd.decide.calibration import Calibration, calibration_key, combine_calibrations
from tunerd.decide.model_info import ModelInfo
from tunerd.durable import atomic_write
from tunerd.engine.params import Backend, EngineParams


class CalibrationStore:
    """Calibrations per model and non-KV-relevant configuration, in one JSON file in the state dir.

    Each key (`calibration_key`) keeps its last `keep` starts; `get` combines them
    (`combine_calibrations`). When the exact key has none, the newest calibration of the same model and
    backend is used and a note says so. A missing or damaged file reads as empty. Writes are atomic
    (`tunerd.durable.atomic_write`: temp file, fsync, rename over, fsync the directory).
    """

    FILENAME = "planner-calibration.json"

    def __init__(self, state_dir: str | Path, keep: int = 8) -> None:
        self.path = Path(state_dir) / self.FILENAME
        self.keep = keep

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            # Missing, unreadable or damaged: it must not stop the daemon (the next start recalibrates).
            return {"version": 1, "entries": {}}
        if not isinstance(data, dict) or not isinstance(data.get("entries"), dict):
            return {"version": 1, "entries": {}}
        return data

    def get(self, model: ModelInfo, params: EngineParams, backend: Backend) -> Calibration | None:
        """The combined calibration for this configuration, else the newest one of the same model and
        backend (with a note), else None. Reads the file; never raises for a missing or damaged one."""
        key = calibration_key(model, params, backend)
        entries = self._load()["entries"]
        if entries.get(key):
            return combine_calibrations([Calibration.from_json(r) for r in entries[key]])
        prefix = f"{model.identity}|{backend}|"
        others = [k for k in entries if k.startswith(prefix) and entries[k]]
        if not others:
            return None
        newest = max(others, key=lambda k: entries[k][-1].get("_stored_at", 0))
        cal = combine_calibrations([Calibration.from_json(r) for r in entries[newest]])
        if cal is None:
            return None
        return replace(cal, notes=(*cal.notes, f"from another configuration ({newest.split('|', 2)[2]})"))

    def put(
        self,
        model: ModelInfo,
        params: EngineParams,
        backend: Backend,
        calibration: Calibration,
        *,
        now: float,
    ) -> None:
        """Append `calibration` under this configuration's key (wall time `now` recorded), keeping the last
        `keep`; rewrites the file atomically. Raises OSError if it can't be written."""
        data = self._load()
        key = calibration_key(model, params, backend)
        record = calibration.to_json()
        record["_stored_at"] = now
        entries = data["entries"].setdefault(key, [])
        entries.append(record)
        del entries[: max(0, len(entries) - self.keep)]
        atomic_write(self.path, json.dumps(data, indent=1, sort_keys=True).encode())
