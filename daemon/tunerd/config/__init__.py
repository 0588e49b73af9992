"""tunerd.toml → validated, typed configuration. Unknown keys are errors.

`load_config(path)` returns a `Config` or raises `ConfigError` whose `problems` are lines of the form
`file: key: reason` — what `tunerd check-config` prints and what `tunerd run` prints before exiting 78.
Types are strict where TOML writes them: a boolean is not a count, `"3"` is not a number, `3.5` is not
a whole number (an integer stands for a float: `60` seconds). A path has no TOML literal: it is a string.
Just over 400 lines: the sections of tunerd.toml are one schema, each with its defaults beside it (the
door's and the rules' schemas have their own modules).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunerd.config.door import DoorConfig
from tunerd.config.memory import MemoryConfig
from tunerd.config.objective import ObjectiveConfig, resolve_alias
from tunerd.core.hosts import is_loopback
from tunerd.core.params import LIVE_PARAMS, TUNABLE_PARAMS, EngineParams

if TYPE_CHECKING:
    from tunerd.config.rules import RuleSet

DEFAULT_CONFIG_PATH = "/etc/tunerd/tunerd.toml"
CONFIG_ENV = "TUNERD_CONFIG"

PositiveSeconds = Annotated[float, Field(gt=0)]
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _paths_from_strings(cls, data: Any) -> Any:
        """TOML has no path literal: a path field is written as a string, which strict validation (see
        `parse_config`) would refuse as "not an instance of Path"; make it one first."""
        if not isinstance(data, dict):
            return data
        paths = _path_fields(cls)
        return {
            key: Path(value) if key in paths and isinstance(value, str) else value
            for key, value in data.items()
        }


def _path_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of `model` annotated `Path` or `Path | None`."""
    found = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if annotation is Path or Path in get_args(annotation):
            found.add(name)
    return frozenset(found)


class NumactlConfig(_Section):
    """Bind the engine to a NUMA node with numactl (e.g. the GPU's node)."""

    enabled: bool = False
    command: str = "numactl"
    cpunodebind: int | None = Field(default=None, ge=0)
    membind: int | None = Field(default=None, ge=0)


class EngineConfig(_Section):
    command: list[str] = Field(default_factory=lambda: ["vllm", "serve"], min_length=1)
    model: str = Field(min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    params: EngineParams = Field(default_factory=EngineParams)
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    numactl: NumactlConfig = Field(default_factory=NumactlConfig)
    # vLLM's per-request (uvicorn) access log: "auto" = off while [door] is on, "on", "off".
    access_log: Literal["auto", "on", "off"] = "auto"
    # vLLM's per-request metrics (`--enable-per-request-metrics`): "auto" = on while [door] is on and
    # this vLLM's --help lists the flag, unless extra_args has --disable-log-stats; "off".
    per_request_metrics: Literal["auto", "off"] = "auto"
    # `--custom-histogram-buckets` with edges at the [objective] targets: "auto" = where --help lists it
    # and a target is set; "off".
    histogram_buckets: Literal["auto", "off"] = "auto"

    @field_validator("command")
    @classmethod
    def _command_has_program(cls, value: list[str]) -> list[str]:
        if not value[0].strip():
            raise ValueError("the first element must name a program")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra_args_not_managed(cls, value: list[str]) -> list[str]:
        managed = {name.replace("_", "-") for name in EngineParams.model_fields} | {"model", "host", "port"}
        for arg in value:
            if not arg.startswith("--"):
                continue
            # vLLM's parser reads --max_model_len as --max-model-len, and --no-x negates --x.
            name = arg[2:].split("=", 1)[0].replace("_", "-")
            if name.removeprefix("no-") in managed:
                flag = arg.split("=", 1)[0]
                raise ValueError(f"{flag} is managed by tunerd: set it in [engine] or [engine.params]")
        return value

    def extra_flag(self, name: str) -> str | None:
        """The value `extra_args` gives vLLM's `--name` (`--name V` or `--name=V`, `_` or `-`; the last
        one wins, as in vLLM's parser), or None when it is not there."""
        found = None
        args = self.extra_args
        for i, arg in enumerate(args):
            flag, eq, value = arg.partition("=")
            if flag.replace("_", "-") != f"--{name.replace('_', '-')}":
                continue
            found = value if eq else (args[i + 1] if i + 1 < len(args) else None)
        return found


class TimeoutsConfig(_Section):
    startup_s: PositiveSeconds = 900.0
    graceful_stop_s: PositiveSeconds = 30.0
    unready_stop_s: PositiveSeconds = 5.0
    drain_s: float = Field(default=20.0, ge=0)
    health_interval_s: PositiveSeconds = 5.0
    health_timeout_s: PositiveSeconds = 2.0
    health_failures: int = Field(default=3, ge=1)


class BackoffConfig(_Section):
    initial_s: PositiveSeconds = 10.0
    max_s: PositiveSeconds = 300.0
    multiplier: float = Field(default=2.0, ge=1.0)
    reset_after_s: PositiveSeconds = 600.0
    known_good_after_s: PositiveSeconds = 60.0
    max_failures: int = Field(default=3, ge=1)

    @model_validator(mode="after")
    def _max_not_below_initial(self) -> BackoffConfig:
        if self.max_s < self.initial_s:
            raise ValueError(f"max_s ({self.max_s}) is below initial_s ({self.initial_s})")
        return self


class PathsConfig(_Section):
    state_dir: Path = Path("/var/lib/tunerd")
    journal: Path | None = None
    socket: Path | None = None
    engine_logs_kept: int = Field(default=10, ge=1)
    # One run's live log is rotated past this size (below 64 KiB a rotation would come every few
    # seconds under load); `engine_log_backups` rotated copies are kept beside it (0: none).
    engine_log_max_bytes: int = Field(default=16 * 1024 * 1024, ge=64 * 1024)
    engine_log_backups: int = Field(default=1, ge=0, le=99)

    @model_validator(mode="after")
    def _socket_path_fits(self) -> PathsConfig:
        length = len(os.fsencode(self.socket_path))
        if length > MAX_SOCKET_PATH:
            key = "socket" if self.socket is not None else "state_dir"
            raise ValueError(
                f"{key}: the operator socket {self.socket_path} is {length} bytes long, over the "
                f"{MAX_SOCKET_PATH} a unix socket allows: set paths.socket to a shorter path"
            )
        return self

    @property
    def socket_path(self) -> Path:
        """The operator socket (`tunerd restart`, `resume` …): `socket`, else state_dir/tunerd.sock."""
        return self.socket if self.socket is not None else self.state_dir / "tunerd.sock"

    @property
    def journal_path(self) -> Path:
        return self.journal if self.journal is not None else self.state_dir / "journal.jsonl"

    @property
    def engine_log_dir(self) -> Path:
        return self.state_dir / "engine-logs"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def export_address_file(self) -> Path:
        return self.state_dir / "export.addr"


class ObserveConfig(_Section):
    poll_interval_s: PositiveSeconds = 1.0
    window_s: PositiveSeconds = 60.0
    # NVML samples PCIe TX and RX over ~20 ms each: 40 ms of the poll thread's time per poll.
    gpu_pcie: bool = True
    # Where meminfo and pressure/memory are read (a container can point at the host's /proc).
    memory_proc: str = "/proc"


class GuardConfig(_Section):
    interval_s: PositiveSeconds = 0.5
    min_available_bytes: int = Field(default=2 << 30, ge=0)
    min_available_ratio: float = Field(default=0.03, ge=0, lt=1)
    max_psi_full_avg10: float = Field(default=60.0, gt=0, le=100)
    emergency_grace_s: PositiveSeconds = 2.0
    wedge_after_s: float = Field(default=120.0, ge=0)


class PreflightConfig(_Section):
    max_wait_s: PositiveSeconds = 180.0
    memory_tolerance_bytes: int = Field(default=1 << 30, ge=0)
    memory_tolerance_ratio: float = Field(default=0.05, ge=0, lt=1)
    # A large page cache on unified memory, before a start: off | advise (a journal line) | fadvise (drop
    # the model files' own cache: posix_fadvise, no privilege) | drop (sync + all of it: uid 0 only).
    # The booleans of earlier versions still read: false = advise, true = drop.
    drop_page_cache: Literal["off", "advise", "fadvise", "drop"] = "fadvise"
    page_cache_advice_ratio: float = Field(default=0.10, gt=0, le=1)
    planner: Literal["enforce", "warn", "off"] = "enforce"

    @field_validator("drop_page_cache", mode="before")
    @classmethod
    def _page_cache_boolean(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "drop" if value else "advise"
        return value


class ExportConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=9464, ge=0, le=65535)  # 0: any free port (written to state_dir/export.addr)


class MaintenanceWindow(_Section):
    """A time when trials may run: starts at each time `cron` names (crontab syntax, local time, through
    APScheduler's CronTrigger) and lasts `duration_s`."""

    cron: str = Field(min_length=1)
    duration_s: PositiveSeconds

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, value: str) -> str:
        from apscheduler.triggers.cron import CronTrigger

        try:
            CronTrigger.from_crontab(value)
        except ValueError as exc:
            raise ValueError(f"{value!r} is not a crontab expression: {exc}") from None
        return value

    def opened_at(self, now: datetime) -> datetime | None:
        """When this window opened if `now` (an aware datetime, whose zone the cron is read in) lies in
        it, else None. The one home of the cron arithmetic (the policy imports no scheduler)."""
        from apscheduler.triggers.cron import CronTrigger

        trigger = CronTrigger.from_crontab(self.cron, timezone=now.tzinfo)
        opened = trigger.get_next_fire_time(None, now - timedelta(seconds=self.duration_s))
        return opened if opened is not None and opened <= now else None


class ProbeConfig(_Section):
    """The benchmark probe: a fixed, cache-cold workload against the engine's OpenAI API (a sensor)."""

    enabled: bool = True
    prompt_tokens: int = Field(default=128, ge=1)
    max_tokens: int = Field(default=128, ge=1)  # generated with ignore_eos: exactly this many per request
    requests: int = Field(default=8, ge=1)
    concurrency: int = Field(default=4, ge=1)
    timeout_s: PositiveSeconds = 120.0
    interval_s: float = Field(default=900.0, ge=0)  # periodic health check; 0: only on demand
    cron: str | None = None  # instead of interval_s: crontab times (off-peak), local time
    skip_when_running_above: float = Field(default=0.0, ge=0)  # live traffic first: skipped while busier

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, value: str | None) -> str | None:
        return value if value is None else MaintenanceWindow._cron_parses(value)


class CacheResetConfig(_Section):
    """Off-peak reset of vLLM's prefix cache (`POST /reset_prefix_cache`, vLLM's dev mode only)."""

    cron: str | None = None  # e.g. "30 3 * * *"; None: never
    retries: int = Field(default=5, ge=0)
    retry_after_s: PositiveSeconds = 10.0

    @field_validator("cron")
    @classmethod
    def _cron_parses(cls, value: str | None) -> str | None:
        return value if value is None else MaintenanceWindow._cron_parses(value)


class TuningConfig(_Section):
    """The tuning loop: rules propose one change at a time; each is a trial, verified and kept or
    reverted (etc/tunerd/tunerd.toml documents every key)."""

    mode: Literal["auto", "dry-run", "off"] = "auto"
    rules: Path | None = None  # None: rules.toml beside the config file, if there is one
    warmup_s: float = Field(default=20.0, ge=0)
    window_s: PositiveSeconds = 60.0
    # The after window's extension budget in all (it doubles, tune/trials.Windows) when the evidence
    # cannot tell yet or the offered load changed (policy/verdict.py).
    max_extend_s: float = Field(default=3780.0, ge=0)
    # Deprecated: `[objective] kind` is the one place (config/objective.py). After loading, this holds the
    # configured kind's objective, what a trial compares when it is in force (policy/verdict.py).
    objective: Literal["throughput.generation", "ttft.p95", "itl.p95", "e2e.p95", "slo.goodput"] = (
        "throughput.generation"
    )
    tolerance: float = Field(default=0.05, ge=0, lt=1)
    confidence: float = Field(default=0.95, gt=0.5, lt=1)  # of the intervals a trial's verdict acts on
    load_tolerance: float = Field(default=0.25, gt=0, lt=1)
    saturated_waiting: float = Field(default=0.5, ge=0)
    saturated_kv_usage: float = Field(default=0.9, gt=0, le=1)
    ttft_p95_max_s: float | None = Field(default=None, gt=0)
    itl_p95_max_s: float | None = Field(default=None, gt=0)
    itl_p95_max_increase: float = Field(default=1.0, ge=0)
    restarts_per_hour: int = Field(default=4, ge=0)
    restarts_per_day: int = Field(default=24, ge=0)
    min_serving_s: float = Field(default=300.0, ge=0)
    tabu_s: float = Field(default=6 * 3600.0, ge=0)
    mute_after_losses: int = Field(default=2, ge=1)
    mute_s: float = Field(default=6 * 3600.0, ge=0)
    unified_max_gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1)
    maintenance: list[MaintenanceWindow] = Field(default_factory=list)
    explore_in_windows: list[str] = Field(default_factory=list)  # params explored once per window
    explore_tolerance: float = Field(default=0.03, ge=0, lt=1)  # the floor: a move must gain more (confirmed)
    explore_probes: int = Field(default=3, ge=2, le=20)  # the most probes of one point in one start
    # The relative spread of one vLLM start's mean objective that no window of it can see (a trial's and an
    # exploration's two sides are two starts): bench/noise.py measures it (docs/noise.md).
    start_noise: float = Field(default=0.05, ge=0, lt=1)
    # The most vLLM starts a side one trial compares over (its first pair included): while the spread
    # between starts is the larger part of a straddling ratio's noise, the trial restarts to the
    # configuration before and to the change again, a window each (tune/trials.py). 1: one start a side.
    max_starts: int = Field(default=32, ge=1, le=64)
    bounds: dict[str, tuple[float, float]] = Field(default_factory=dict)

    @field_validator("bounds", mode="before")
    @classmethod
    def _bounds_from_arrays(cls, value: Any) -> Any:
        """TOML writes a pair as an array (`[8, 64]`); strict validation takes only a tuple for one."""
        if isinstance(value, dict):
            return {k: tuple(v) if isinstance(v, list) else v for k, v in value.items()}
        return value

    @field_validator("bounds")
    @classmethod
    def _bounds_name_tunables(cls, value: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        known = (*TUNABLE_PARAMS, *LIVE_PARAMS)
        for name, (low, high) in value.items():
            if name not in known:
                raise ValueError(f"{name!r} is not a tunable parameter (one of: {', '.join(known)})")
            if not low <= high:
                raise ValueError(f"{name}: low {low:g} is above high {high:g}")
        return value


class LoggingConfig(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class Config(_Section):
    engine: EngineConfig
    timeouts: TimeoutsConfig = Field(default_factory=TimeoutsConfig)
    backoff: BackoffConfig = Field(default_factory=BackoffConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    observe: ObserveConfig = Field(default_factory=ObserveConfig)
    guard: GuardConfig = Field(default_factory=GuardConfig)
    preflight: PreflightConfig = Field(default_factory=PreflightConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    tuning: TuningConfig = Field(default_factory=TuningConfig)
    probe: ProbeConfig = Field(default_factory=ProbeConfig)
    cache_reset: CacheResetConfig = Field(default_factory=CacheResetConfig)
    door: DoorConfig = Field(default_factory=DoorConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _door_in_front_of_a_private_vllm(self) -> Config:
        """With the door on, clients use door.port and vLLM listens on loopback, on a port of its own."""
        door, engine = self.door, self.engine
        if engine.port == self.export.port:
            raise ValueError(f"export: port {engine.port} is also engine.port: vLLM needs a port of its own")
        if not door.enabled:
            return self
        if door.port == engine.port:
            raise ValueError(
                f"door: port {door.port} is also engine.port: vLLM needs a port of its own behind the door "
                "(the shipped config: engine.port = 18000)"
            )
        if door.port and door.port == self.export.port:
            raise ValueError(f"door: port {door.port} is also export.port")
        if not is_loopback(engine.host):
            raise ValueError(
                f"door: engine.host {engine.host!r} is not loopback: behind the door vLLM listens on "
                "127.0.0.1 (what goes around the door is neither held across a restart nor counted)"
            )
        return self

    @model_validator(mode="after")
    def _on_time_first_needs_a_ttft_target(self) -> Config:
        """`[door] order = "on_time_first"` judges lateness by the goodput objective's TTFT target: without
        one it would quietly stay first come, first served."""
        objective = self.objective
        if self.door.order == "on_time_first" and (objective.kind != "goodput" or objective.ttft_s is None):
            raise ValueError(
                'door: order = "on_time_first" needs [objective] kind = "goodput" with ttft_s (a request is '
                "late once it has waited that long)"
            )
        return self

    @model_validator(mode="after")
    def _probe_fits_the_context(self) -> Config:
        """A probe request longer than the context is refused by vLLM (HTTP 400): say so at load."""
        limit, probe = self.engine.params.max_model_len, self.probe
        if probe.enabled and limit is not None and probe.prompt_tokens + probe.max_tokens > limit:
            raise ValueError(
                f"probe: prompt_tokens + max_tokens = {probe.prompt_tokens + probe.max_tokens} is over "
                f"engine.params.max_model_len {limit}: vLLM would refuse every probe request"
            )
        return self


class ConfigError(Exception):
    """The config could not be loaded. `problems` holds one `file: key: reason` line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def default_config_path() -> str:
    """`$TUNERD_CONFIG`, else /etc/tunerd/tunerd.toml."""
    return os.environ.get(CONFIG_ENV) or DEFAULT_CONFIG_PATH


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a config file. Raises ConfigError listing every problem found."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError([f"{name}: (file): cannot read: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{name}: (syntax): {exc}"]) from None
    return parse_config(data, name)


def parse_config(data: dict[str, Any], name: str = "<config>") -> Config:
    """Validate an already-parsed TOML document, strictly (TOML is typed: `max_failures = true` is a
    boolean, not a count; pydantic's lax mode would read it as 1). Raises ConfigError."""
    try:
        data = resolve_alias(data)  # [tuning] objective, deprecated, into [objective] kind
    except ValueError as exc:
        raise ConfigError([f"{name}: tuning.objective: {exc}"]) from None
    try:
        return Config.model_validate(data, strict=True)
    except ValidationError as exc:
        raise ConfigError([_format_error(name, err) for err in exc.errors()]) from None


def _format_error(name: str, err: Any) -> str:
    key = ".".join(str(part) for part in err["loc"]) or "(top level)"
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        msg = "unknown key"
    elif kind == "missing":
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    elif "input" in err and kind not in ("model_type", "dict_type"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{name}: {key}: {msg}"


@dataclass(frozen=True)
class Loaded:
    """A validated config with the rules it names (`rules` None: no rules file, or tuning is off)."""

    config: Config
    rules: RuleSet | None
    rules_path: str | None


def load_all(path: str | os.PathLike[str]) -> Loaded:
    """The config and its rules file, both validated. Raises ConfigError listing every problem of both.

    The rules file is `tuning.rules` (relative to the config's directory), else `rules.toml` beside
    the config when it exists. An explicitly named file must exist; with `tuning.mode = "off"` the
    rules are not read.
    """
    from tunerd.config.rules import load_rules

    config = load_config(path)
    if config.tuning.mode == "off":
        return Loaded(config, None, None)
    rules_path = resolve_rules_path(config, path)
    if rules_path is None:
        return Loaded(config, None, None)
    return Loaded(config, load_rules(rules_path), rules_path)


def resolve_rules_path(config: Config, config_path: str | os.PathLike[str]) -> str | None:
    """Where the rules are: `tuning.rules` against the config's directory, else an existing
    `rules.toml` beside the config, else None."""
    base = Path(os.fspath(config_path)).parent
    if config.tuning.rules is not None:
        return str(base / config.tuning.rules)
    beside = base / "rules.toml"
    return str(beside) if beside.is_file() else None
