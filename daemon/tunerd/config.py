"""tunerd.toml → validated, typed configuration. Unknown keys are errors.

`load_config(path)` returns a `Config` or raises `ConfigError` whose `problems` are lines of the form
`file: key: reason` — what `tunerd check-config` prints and what `tunerd run` prints before exiting 78.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunerd.core.params import EngineParams

DEFAULT_CONFIG_PATH = "/etc/tunerd/tunerd.toml"
CONFIG_ENV = "TUNERD_CONFIG"

PositiveSeconds = Annotated[float, Field(gt=0)]
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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
    drop_page_cache: bool = False
    page_cache_advice_ratio: float = Field(default=0.10, gt=0, le=1)
    planner: Literal["enforce", "warn", "off"] = "enforce"


class ExportConfig(_Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = Field(default=9464, ge=0, le=65535)  # 0: any free port (written to state_dir/export.addr)


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
    logging: LoggingConfig = Field(default_factory=LoggingConfig)


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
    """Validate an already-parsed TOML document. Raises ConfigError."""
    try:
        return Config.model_validate(data)
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
