"""The tuning memory: every trial's, probe's and exploration point's outcome, by model, hardware, vLLM
version and workload shape — "over time the best settings for each model and load show a pattern".

One JSON file (`state_dir/experience.json`), plain and versioned so that an operator can read and diff
it: a header, then one entry per line, oldest first, the last `MAX_ENTRIES` kept. Every change is a
read-merge-write under an flock on `<file>.lock`, replaced atomically (`records.durable.atomic_write`),
so `tunerd memory import` beside a running daemon loses nothing. A missing file reads as empty; an
unreadable or damaged one too (`load_error` says why, and it is kept as `<file>.damaged` at the next
write): the memory never stops the daemon.

Every value names its objective (policy/objective.py): `objective_name`, `objective_unit` and
`objective_source` (what measured it: "live", the window of real traffic, or "probe", the benchmark
probe), so tok/s and seconds never read as one figure, and an entry is filed under the workload key of
what measured it. Entries written before these fields read still: a probe's value was always the
probe's generation throughput, an exploration point's that throughput from a source not recorded, a
trial's value is of no objective the entry can name (it is not ranked).

Queries take one `ExperienceKey`; `best`, `bad_values` and `measured` use verified entries only unless
asked; `best` and `measured` compare values of one named objective (and source) only — and of one unit
when asked (`unit`): goodput is requests/s or output tokens/s under one name (`[objective] count`).
An upgrade (`mark_unverified`) keeps old entries but flags them: hints, not truth. vLLM's version is
part of the key, so after an upgrade the new key starts empty; `any_vllm=True` asks across versions for
a first proposal.

Over 400 lines: the file format (versioned, one entry per line), its damage handling, import/export and
the queries over one store; splitting them would split one format's rules across modules.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
import uuid
from collections.abc import Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from tunerd.records.durable import atomic_write

FORMAT = "tunerd-experience"
VERSION = 1
FILE_NAME = "experience.json"
MAX_ENTRIES = 2000
KINDS = ("trial", "probe", "explore")
# Decisions that make a trial's or exploration point's value bad (the tuner's "revert"; "failed": the
# start failed, a limit broke, the point was infeasible). Every other decision is an acceptable outcome.
BAD_DECISIONS = frozenset({"revert", "failed"})
Kind = Literal["trial", "probe", "explore"]


class ExperienceFormatError(ValueError):
    """A file that is not a tuning memory of this format version; the message says what it is."""


def experience_path(state_dir: str | os.PathLike[str]) -> Path:
    return Path(state_dir) / FILE_NAME


@dataclass(frozen=True, order=True)
class ExperienceKey:
    """What makes two outcomes comparable: the model's identity, the hardware, vLLM's version (None:
    unknown) and the workload's shape (`workload_key`)."""

    model: str
    hardware: str
    vllm: str | None
    workload: str

    @property
    def text(self) -> str:
        """Stable text form, e.g. `3f9a… | cuda:NVIDIA H200:140GiB | vllm 0.32.0 | prompt~128 …`."""
        return f"{self.model} | {self.hardware} | vllm {self.vllm or 'unknown'} | {self.workload}"

    def __str__(self) -> str:
        return self.text

    def comparable(self, other: ExperienceKey, *, any_vllm: bool = False) -> bool:
        return self == other or (any_vllm and replace(self, vllm=None) == replace(other, vllm=None))


def hardware_key(gpu_name: str | None, gpu_total_bytes: int | None, unified: bool, backend: str) -> str:
    """The hardware part of a key: `cpu`, `unified:NVIDIA GB10` (the memory is the host's, NVML reports
    none) or `cuda:NVIDIA H200:140GiB` (total memory rounded to whole GiB: 143,771 MiB → 140GiB)."""
    if backend == "cpu":
        return "cpu"
    name = (gpu_name or "unknown").strip() or "unknown"
    if unified:
        return f"unified:{name}"
    if gpu_total_bytes is None or gpu_total_bytes <= 0:
        return f"{backend}:{name}"
    return f"{backend}:{name}:{round(gpu_total_bytes / (1 << 30))}GiB"


def workload_key(prompt_tokens: float, output_tokens: float, concurrency: float) -> str:
    """The workload's shape with each size rounded to the nearest power of two (in log scale; below 1:
    1, none or not finite: 0), so that a comparable load maps to one key: 100 and 128 prompt tokens
    both give "prompt~128", 90 gives "prompt~64"."""
    return (
        f"prompt~{_bucket(prompt_tokens)} output~{_bucket(output_tokens)} concurrency~{_bucket(concurrency)}"
    )


def _bucket(value: float) -> int:
    if value is None or not math.isfinite(value) or value <= 0:
        return 0
    return 2 ** max(0, round(math.log2(value)))


def model_key(identity: Mapping[str, Any]) -> str:
    """The model part of a key from `observe.identity.model_identity`'s facts: the fingerprint of a
    local directory, else the repo id or path."""
    for name in ("fingerprint", "id", "path"):
        if identity.get(name):
            return str(identity[name])
    return "unknown"


@dataclass(frozen=True)
class Entry:
    """One outcome. `params`: the whole configuration measured; `objective`: its value (None: none,
    e.g. the start failed) of the objective `objective_name` in `objective_unit`, measured by
    `objective_source` ("live" or "probe"; None: not recorded, an entry of an older tunerd);
    `figures["param"]`, for a trial or exploration point, names the parameter it changed; `unverified`:
    why it no longer counts as truth (None: it does); `origin`: the file it was imported from (None:
    measured here); `id`: unique, given when recorded (the shared memory's key, tune/fleet.py; an
    entry of an older tunerd has none: `entry_id` derives one); `host`: the box of the fleet that
    measured it (None: this one)."""

    key: ExperienceKey
    kind: str
    params: Mapping[str, Any]
    objective: float | None
    decision: str
    figures: Mapping[str, Any]
    at: float
    unverified: str | None = None
    origin: str | None = None
    objective_name: str | None = None
    objective_unit: str | None = None
    objective_source: str | None = None
    id: str | None = None
    host: str | None = None

    @property
    def verified(self) -> bool:
        return self.unverified is None

    def identity(self) -> str:
        """What makes two entries the same (imports skip duplicates): everything but the flags."""
        return _dumps([self.key.text, self.kind, self.params, self.objective, self.decision, self.at])

    def entry_id(self) -> str:
        """`id`, else one derived from `identity` (stable: the same entry gets the same id anywhere)."""
        return self.id or hashlib.sha256(self.identity().encode()).hexdigest()[:32]

    def as_dict(self) -> dict[str, Any]:
        """The entry as the file holds it (`unverified` and `origin` only when set)."""
        document = {**asdict(self), "params": dict(self.params), "figures": dict(self.figures)}
        return {name: value for name, value in document.items() if value is not None or name == "objective"}

    @classmethod
    def from_dict(cls, raw: Any) -> Entry:
        """Raises ValueError, KeyError or TypeError for a malformed entry."""
        key, objective = raw["key"], raw.get("objective")
        entry = cls(
            key=ExperienceKey(
                str(key["model"]), str(key["hardware"]), _text(key, "vllm"), str(key["workload"])
            ),
            kind=str(raw["kind"]),
            params=dict(raw["params"]),
            objective=None if objective is None else float(objective),
            decision=str(raw["decision"]),
            figures=dict(raw.get("figures") or {}),
            at=float(raw["at"]),
            unverified=_text(raw, "unverified"),
            origin=_text(raw, "origin"),
            objective_name=_text(raw, "objective_name"),
            objective_unit=_text(raw, "objective_unit"),
            objective_source=_text(raw, "objective_source"),
            id=_text(raw, "id"),
            host=_text(raw, "host"),
        )
        if entry.kind not in KINDS:
            raise ValueError(f"kind {entry.kind!r} is not one of {', '.join(KINDS)}")
        return _named(entry)


@dataclass(frozen=True)
class ImportReport:
    """What `import_` did: entries `added`, `duplicates` skipped, the `total` now, and `dropped` (the
    oldest, past `MAX_ENTRIES`)."""

    added: int
    duplicates: int
    total: int
    dropped: int
    skipped: tuple[str, ...] = field(default=())  # malformed entries of the imported file, why


class Experience:
    """The tuning memory in the file `path`. Queries read the file again when it changed on disk;
    `record` returns False (and sets `save_error`) when the file cannot be written: the entry is kept
    in memory and written with the next one."""

    def __init__(self, path: str | os.PathLike[str], *, max_entries: int = MAX_ENTRIES) -> None:
        self.path = Path(path)
        self.max_entries = max_entries
        self.load_error: str | None = None
        self.save_error: str | None = None
        self._entries: list[Entry] = []
        self._pending: list[Entry] = []  # recorded, not yet on disk
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) of the file last read
        self._damaged = False
        self._refresh()

    # -- queries ------------------------------------------------------------------------------------

    def entries(self, key: ExperienceKey | None = None, *, any_vllm: bool = False) -> list[Entry]:
        """Every entry of `key` (None: all), oldest first, verified or not."""
        self._refresh()
        everything = [*self._entries, *self._pending]
        return [e for e in everything if key is None or e.key.comparable(key, any_vllm=any_vllm)]

    def known_keys(self) -> list[ExperienceKey]:
        """The keys that have entries, in the order they first appear."""
        return list(dict.fromkeys(e.key for e in self.entries()))

    def objectives(self, key: ExperienceKey) -> list[str]:
        """The names of the objectives `key`'s entries have values of, in the order they first appear."""
        named = (e.objective_name for e in self.entries(key) if e.objective is not None)
        return [name for name in dict.fromkeys(named) if name is not None]

    def units(self, key: ExperienceKey, objective: str) -> list[str | None]:
        """The units `key`'s values of the objective called `objective` are in, in the order they first
        appear (goodput's follow what it counted; None: an entry that named none)."""
        found = (
            e.objective_unit
            for e in self.entries(key)
            if e.objective is not None and e.objective_name == objective
        )
        return list(dict.fromkeys(found))

    def best_entry(
        self,
        key: ExperienceKey,
        *,
        objective: str,
        maximize: bool,
        source: str | None = None,
        unit: str | None = None,
        include_unverified: bool = False,
        any_vllm: bool = False,
        kinds: Collection[str] = KINDS,
    ) -> Entry | None:
        """The entry with the best value of the objective called `objective` (the highest; `maximize=False`:
        the lowest — the objective's direction), measured by `source` (None: any), among those with a
        value and an acceptable decision (not in BAD_DECISIONS); the latest on a tie. Values of other
        objectives (or, with `unit`, in another unit) do not compare and are not considered."""
        best: Entry | None = None
        sign = 1.0 if maximize else -1.0
        for entry in self._usable(key, include_unverified, any_vllm, kinds):
            if entry.objective is None or entry.decision in BAD_DECISIONS:
                continue
            if not _measures(entry, objective, source, unit):
                continue
            if best is None or sign * entry.objective >= sign * best.objective:  # type: ignore[operator]
                best = entry
        return best

    def best(self, key: ExperienceKey, **options: Any) -> dict[str, Any] | None:
        """The params of `best_entry` (the objective and its direction are among `options`), or None."""
        entry = self.best_entry(key, **options)
        return None if entry is None else dict(entry.params)

    def bad_values(
        self, key: ExperienceKey, *, include_unverified: bool = False
    ) -> list[tuple[str, Any, str]]:
        """(param, value, why) for each value whose latest trial or exploration point failed or lost —
        decision in BAD_DECISIONS, or no objective — for the tabu list at a start. The parameter is the
        entry's `figures["param"]`; entries without it are not counted. A value whose latest outcome
        is good again is not listed."""
        latest: dict[tuple[str, str], tuple[str, Any, str] | None] = {}
        for entry in self._usable(key, include_unverified, False, ("trial", "explore")):
            param = entry.figures.get("param")
            if not isinstance(param, str) or param not in entry.params:
                continue
            value = entry.params[param]
            bad = entry.decision in BAD_DECISIONS or entry.objective is None
            why = f"{entry.kind} {entry.decision}"
            if entry.figures.get("reason"):
                why += f": {entry.figures['reason']}"
            latest[(param, _dumps(value))] = (param, value, why) if bad else None
        return [item for item in latest.values() if item is not None]

    def measured(
        self,
        key: ExperienceKey,
        param: str,
        others: Mapping[str, Any],
        *,
        objective: str,
        source: str,
        unit: str | None = None,
        include_unverified: bool = False,
        kinds: Collection[str] = KINDS,
    ) -> dict[Any, float | None]:
        """{value of `param`: value of `objective`} of the entries of that objective measured by `source`
        where every parameter of `others` had that value (parameters not in `others` are not compared):
        the latest measurement of each value; None where it failed or lost (decision in BAD_DECISIONS:
        infeasible for the search, never chosen; a failure has no objective and counts for any). For an
        exploration to skip points already measured."""
        points: dict[Any, float | None] = {}
        for entry in self._usable(key, include_unverified, False, kinds):
            bad = entry.decision in BAD_DECISIONS
            if not bad and not _measures(entry, objective, source, unit):
                continue
            if param not in entry.params or any(
                k != param and (k not in entry.params or entry.params[k] != v) for k, v in others.items()
            ):
                continue
            points[entry.params[param]] = None if entry.decision in BAD_DECISIONS else entry.objective
        return points

    def _usable(
        self, key: ExperienceKey, include_unverified: bool, any_vllm: bool, kinds: Collection[str]
    ) -> Iterator[Entry]:
        for entry in self.entries(key, any_vllm=any_vllm):
            if entry.kind in kinds and (include_unverified or entry.verified):
                yield entry

    # -- changes ------------------------------------------------------------------------------------

    def record(
        self,
        key: ExperienceKey,
        params: Mapping[str, Any],
        objective: float | None,
        *,
        kind: Kind,
        decision: str,
        figures: Mapping[str, Any],
        at: float,
        objective_name: str | None = None,
        objective_unit: str | None = None,
        objective_source: str | None = None,
    ) -> bool:
        """Add one outcome (`at`: wall time, seconds since the epoch) and write the file; False when it
        could not be written (`save_error` says why; it is retried with the next write). `objective` is a
        value of the objective `objective_name`, in `objective_unit`, measured by `objective_source`
        ("live" or "probe"). Raises ValueError only for a `kind` not in KINDS (a caller's bug)."""
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        value = None if objective is None or not math.isfinite(objective) else float(objective)
        entry = Entry(
            key,
            kind,
            _plain(dict(params)),
            value,
            decision,
            _plain(dict(figures)),
            float(at),
            objective_name=objective_name,
            objective_unit=objective_unit,
            objective_source=objective_source,
            id=uuid.uuid4().hex,
        )
        self._pending.append(_named(entry))
        return self._update(lambda entries: entries)

    def mark_unverified(self, reason: str, *, vllm: str | None = None, driver: str | None = None) -> int:
        """After an upgrade: flag the verified entries measured under another vLLM than `vllm` (their
        key's version) or another driver than `driver` (their `figures["driver"]`; one without it
        counts as another), all of them when neither is given. They stay, as hints. Returns how many
        were flagged and written (0 and `save_error` when the file could not be written)."""
        count = 0

        def flag(entries: list[Entry]) -> list[Entry]:
            nonlocal count
            out = []
            for entry in entries:
                stale = vllm is None and driver is None
                stale |= vllm is not None and entry.key.vllm != vllm
                stale |= driver is not None and entry.figures.get("driver") != driver
                if entry.verified and stale:
                    entry, count = replace(entry, unverified=reason), count + 1
                out.append(entry)
            return out

        return count if self._update(flag) else 0

    def text(self) -> str:
        """Every entry in the file's form (what `export` writes)."""
        return _render(self.entries()).decode()

    def export(self, path: str | os.PathLike[str]) -> int:
        """Write every entry to `path` in this format (mode 0644); returns how many. Raises OSError."""
        entries = self.entries()
        atomic_write(path, _render(entries), mode=0o644)
        return len(entries)

    def import_(self, path: str | os.PathLike[str]) -> ImportReport:
        """Merge the entries of the file `path` (an `export` of another box) without duplicates, ordered
        by time, the oldest dropped past the cap; written at once. Raises ExperienceFormatError for a
        file that is not a memory of this format version, OSError when either file can't be read or
        written (nothing changed then)."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ExperienceFormatError(f"{path}: not a tunerd memory file (not UTF-8 text)") from exc
        incoming, skipped = _parse(text, str(path))
        origin = os.path.basename(os.fspath(path))
        report: dict[str, int] = {}

        def merge(entries: list[Entry]) -> list[Entry]:
            known = {e.identity() for e in entries}
            added = []
            for entry in incoming:
                if entry.identity() not in known:
                    known.add(entry.identity())
                    added.append(entry if entry.origin else replace(entry, origin=origin))
            merged = sorted([*entries, *added], key=lambda e: e.at)
            report.update(added=len(added), duplicates=len(incoming) - len(added), merged=len(merged))
            return merged

        self._update(merge, raise_errors=True)
        total = len(self._entries)
        return ImportReport(report["added"], report["duplicates"], total, report["merged"] - total, skipped)

    # -- the file -----------------------------------------------------------------------------------

    def _update(self, change: Any, *, raise_errors: bool = False) -> bool:
        """Read the file, apply `change` to its entries (and the pending ones), cap, write: under the
        lock. True when written."""
        try:
            with self._locked():
                self._refresh(force=True)
                entries = change([*self._entries, *self._pending])[-self.max_entries :]
                self._write(entries)
        except OSError as exc:
            self.save_error = f"{self.path}: {exc.strerror or exc}"
            if raise_errors:
                raise
            return False
        self._entries, self._pending, self.save_error = entries, [], None
        return True

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, entries: list[Entry]) -> None:
        if self._damaged and self.path.exists():
            os.replace(self.path, f"{self.path}.damaged")  # the operator's data, kept for a look
        atomic_write(self.path, _render(entries))
        self._damaged = False
        if os.geteuid() == 0:  # `sudo tunerd memory import`: the file stays the daemon's to read
            owner = self.path.parent.stat()
            for name in (self.path, Path(f"{self.path}.lock")):
                os.chown(name, owner.st_uid, owner.st_gid)
        with contextlib.suppress(OSError):
            stat = self.path.stat()
            self._seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def _refresh(self, *, force: bool = False) -> None:
        """Read the file again if it changed since it was last read (`force`: always)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            self._entries, self._seen, self.load_error, self._damaged = [], None, None, False
            return
        except OSError as exc:
            self.load_error = f"{self.path}: {exc.strerror or exc}"
            return
        seen = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
        if seen == self._seen and not force:
            return
        self._seen = seen
        try:
            entries, skipped = _parse(self.path.read_text(encoding="utf-8"), str(self.path))
        except (OSError, UnicodeDecodeError, ExperienceFormatError) as exc:
            # Read as empty; the next write moves the file aside rather than over it.
            self._entries, self._damaged = [], True
            where = "" if isinstance(exc, ExperienceFormatError) else f"{self.path}: "
            self.load_error = (
                f"{where}{exc}; read as empty, kept as {self.path.name}.damaged at the next write"
            )
            return
        self._entries, self._damaged = entries, bool(skipped)
        self.load_error = None
        if skipped:
            self.load_error = f"{self.path}: {len(skipped)} damaged entries skipped ({skipped[0]})"


def _parse(text: str, name: str) -> tuple[list[Entry], tuple[str, ...]]:
    """(entries, why each malformed one was skipped) of a memory file's text; raises
    ExperienceFormatError when it is not one of this format version."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ExperienceFormatError(f"{name}: not a tunerd memory file: not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ExperienceFormatError(f'{name}: not a tunerd memory file (no "format": "{FORMAT}")')
    if document.get("version") != VERSION:
        raise ExperienceFormatError(
            f"{name}: format version {document.get('version')!r}, this tunerd reads version {VERSION} only"
        )
    raw = document.get("entries")
    if not isinstance(raw, list):
        raise ExperienceFormatError(f'{name}: "entries" is not a list')
    entries, skipped = [], []
    for number, item in enumerate(raw, 1):
        try:
            entries.append(Entry.from_dict(item))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            skipped.append(f"entry {number}: {type(exc).__name__}: {exc}")
    return entries, tuple(skipped)


def _render(entries: list[Entry]) -> bytes:
    """The file: valid JSON with one entry per line, keys sorted, for a readable diff."""
    lines = ",\n".join(f"  {_dumps(e.as_dict())}" for e in entries)
    body = f"\n{lines}\n " if entries else ""
    return f'{{\n "format": "{FORMAT}",\n "version": {VERSION},\n "entries": [{body}]\n}}\n'.encode()


# What an entry of an older tunerd (no objective fields) measured: a probe's value was the probe's
# generation throughput (tune/recall.py wrote `ProbeResult.throughput`); an exploration point's was that
# throughput too, from the probe or from live traffic (not recorded); a trial's was the verdict's `after`,
# tok/s when saturated and an ITL p95 in seconds otherwise — not knowable from the entry.
_LEGACY: dict[str, tuple[str, str, str | None]] = {
    "probe": ("throughput.generation", "tok/s", "probe"),
    "explore": ("throughput.generation", "tok/s", None),
}


def _named(entry: Entry) -> Entry:
    """`entry` with its objective named where an entry of an older tunerd left it out and its kind says
    what it was."""
    if entry.objective_name is not None or entry.kind not in _LEGACY:
        return entry
    name, unit, source = _LEGACY[entry.kind]
    return replace(entry, objective_name=name, objective_unit=unit, objective_source=source)


def _measures(entry: Entry, objective: str, source: str | None, unit: str | None = None) -> bool:
    """The entry's value is one of `objective`, measured by `source` (None: any), in `unit` (None: any)."""
    return (
        entry.objective_name == objective
        and (source is None or entry.objective_source == source)
        and (unit is None or entry.objective_unit == unit)
    )


def _text(raw: Mapping[str, Any], name: str) -> str | None:
    return None if raw.get(name) is None else str(raw[name])


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(", ", ": "), allow_nan=False)


def _plain(value: Any) -> Any:
    """`value` as JSON can hold it: non-finite floats as None, tuples as lists, other objects as text."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)
