"""rules.toml → validated rules: data, never code. Unknown keys, signals and parameters are errors.

A rule fires when its condition — terms `signal op threshold` over the signals of docs/signals.md,
combined with `all` or `any` — holds for `for_s` without a gap; it then proposes one action: step one
engine parameter in a direction, revert the last change, or only alert. A threshold may be relative to
the baseline recorded for that signal (`throughput.generation < 0.7 * baseline`).

`load_rules(path)` returns a `RuleSet` or raises `ConfigError` whose problems read
`file: rule NAME: key: reason` — what `tunerd check-config` prints. Types are strict, as in tunerd.toml:
`for_s = "60"` is a string, `next = 1` is not a boolean (an integer stands for a float).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tunerd.config import ConfigError
from tunerd.core.params import LIVE_PARAMS, TUNABLE_PARAMS
from tunerd.core.signal_catalog import SIGNAL_NAMES

Op = Literal["<", "<=", ">", ">=", "==", "!="]
_TERM = re.compile(
    r"^\s*(?P<signal>[a-z][a-z0-9_.]*)\s*(?P<op><=|>=|==|!=|<|>)\s*"
    r"(?:(?P<factor>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*\*\s*)?"
    r"(?P<value>baseline|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$"
)


@dataclass(frozen=True, slots=True)
class Term:
    """`signal op threshold`; with `relative`, the threshold is `factor × baseline(signal)`."""

    signal: str
    op: Op
    threshold: float  # the number, or the factor of the baseline when `relative`
    relative: bool = False

    def __str__(self) -> str:
        right = f"{self.threshold:g} * baseline" if self.relative else f"{self.threshold:g}"
        return f"{self.signal} {self.op} {right}"


def parse_term(text: str) -> Term:
    """`kv_cache.usage_avg > 0.9`, `throughput.generation < 0.7 * baseline` → Term. Raises ValueError."""
    match = _TERM.match(text)
    if match is None:
        raise ValueError(
            f"{text!r} is not `signal op number` or `signal op factor * baseline` (op: < <= > >= == !=)"
        )
    signal, op, factor, value = match["signal"], match["op"], match["factor"], match["value"]
    if signal not in SIGNAL_NAMES:
        raise ValueError(f"unknown signal {signal!r} (the signals are listed in docs/signals.md)")
    if value == "baseline":
        return Term(signal, op, float(factor) if factor is not None else 1.0, relative=True)  # type: ignore[arg-type]
    if factor is not None:
        raise ValueError(f"{text!r}: a factor multiplies `baseline`, not a number")
    return Term(signal, op, float(value), relative=False)  # type: ignore[arg-type]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepAction(_Model):
    """Move one parameter: by a factor (`factor = 0.5`), by a step (`by = 4`) or to the next allowed
    value (`next = true`). `then`: the parameters moved the same way, in order, when `param` can move
    no further (at its bound, its next value tabu, the front door off) — e.g. the door's in-flight cap,
    which needs no restart, then `max_num_seqs`."""

    kind: Literal["step"]
    param: str
    direction: Literal["up", "down"]
    factor: float | None = Field(default=None, gt=0)
    by: float | None = Field(default=None, gt=0)
    next: bool = False
    then: list[str] = Field(default_factory=list)

    @field_validator("param")
    @classmethod
    def _tunable(cls, value: str) -> str:
        known = (*TUNABLE_PARAMS, *LIVE_PARAMS)
        if value not in known:
            raise ValueError(f"{value!r} is not a tunable parameter (one of: {', '.join(known)})")
        return value

    @field_validator("then")
    @classmethod
    def _tunables(cls, value: list[str]) -> list[str]:
        for name in value:
            cls._tunable(name)
        return value

    @model_validator(mode="after")
    def _one_way_to_step(self) -> StepAction:
        ways = [name for name in ("factor", "by") if getattr(self, name) is not None] + (
            ["next"] if self.next else []
        )
        if len(ways) != 1:
            raise ValueError("give exactly one of factor, by, next = true")
        if self.factor is not None and (self.factor == 1 or (self.factor < 1) != (self.direction == "down")):
            raise ValueError(f"factor {self.factor:g} does not go {self.direction}: use < 1 down, > 1 up")
        return self


class RevertAction(_Model):
    """Revert the last kept change (alert when there is none)."""

    kind: Literal["revert"]


class AlertAction(_Model):
    """Only say so: journal, log at warning, `tunerd_rule_active`."""

    kind: Literal["alert"]


Action = Annotated[StepAction | RevertAction | AlertAction, Field(discriminator="kind")]


class Rule(_Model):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$", max_length=64)
    why: str = ""
    all: list[str] | None = Field(default=None, min_length=1)
    any: list[str] | None = Field(default=None, min_length=1)
    for_s: float = Field(default=120.0, ge=0)
    cooldown_s: float = Field(default=900.0, ge=0)
    # A term that held stops holding only once its value is this share (of the threshold) past it, so a
    # value hovering at the threshold does not flap.
    hysteresis: float = Field(default=0.05, ge=0, lt=1)
    # safety: kept when its condition eased and nothing failed, even at some cost in throughput
    # (memory, swap); performance: kept only when the objective did not get worse.
    purpose: Literal["performance", "safety"] = "performance"
    action: Action

    @field_validator("all", "any")
    @classmethod
    def _terms_parse(cls, value: list[str] | None) -> list[str] | None:
        problems = []
        for text in value or []:
            try:
                parse_term(text)
            except ValueError as exc:
                problems.append(str(exc))
        if problems:
            raise ValueError("; ".join(problems))  # every bad term, not only the first
        return value

    @model_validator(mode="after")
    def _one_condition(self) -> Rule:
        if (self.all is None) == (self.any is None):
            raise ValueError("give exactly one of all = [...] or any = [...]")
        return self

    @property
    def combine(self) -> Literal["all", "any"]:
        return "all" if self.all is not None else "any"

    @property
    def terms(self) -> tuple[Term, ...]:
        return tuple(parse_term(text) for text in (self.all or self.any or []))


class RuleSet(_Model):
    rule: list[Rule] = Field(default_factory=list)

    @property
    def rules(self) -> tuple[Rule, ...]:
        return tuple(self.rule)


def parse_rules(data: dict[str, Any], name: str = "<rules>") -> RuleSet:
    """Validate an already-parsed rules document. Raises ConfigError with `file: rule NAME: key: reason`."""
    problems = _duplicate_names(name, data)
    try:
        rules = RuleSet.model_validate(data, strict=True)  # TOML is typed: `for_s = "60"` is a string
    except ValidationError as exc:
        problems += [_format_error(name, data, err) for err in exc.errors()]
    if problems:
        raise ConfigError(problems)
    return rules


def _duplicate_names(name: str, data: dict[str, Any]) -> list[str]:
    """`file: rule NAME: name: used by rules #1 and #3` for each name given twice (checked on the raw
    document, so it is reported whatever else is wrong)."""
    rules = data.get("rule")
    if not isinstance(rules, list):
        return []
    where: dict[str, list[int]] = {}
    for index, rule in enumerate(rules):
        if isinstance(rule, dict) and isinstance(rule.get("name"), str):
            where.setdefault(rule["name"], []).append(index + 1)
    problems = []
    for rule_name, places in where.items():
        if len(places) > 1:
            numbers = " and ".join(f"#{i}" for i in places)
            problems.append(f"{name}: rule {rule_name}: name: {rule_name!r} is used twice ({numbers})")
    return problems


def load_rules(path: str) -> RuleSet:
    """Read and validate a rules file. Raises ConfigError listing every problem found."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError([f"{path}: (file): cannot read: {exc.strerror or exc}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: (syntax): {exc}"]) from None
    return parse_rules(data, path)


def _format_error(name: str, data: dict[str, Any], err: Any) -> str:
    loc = [str(part) for part in err["loc"]]
    where = "(top level)"
    if len(loc) >= 2 and loc[0] == "rule" and loc[1].isdigit():
        index = int(loc[1])
        rules = data.get("rule") if isinstance(data.get("rule"), list) else []
        rule_name = (
            rules[index].get("name") if index < len(rules) and isinstance(rules[index], dict) else None
        )
        where = f"rule {rule_name or f'#{index + 1}'}"
        loc = loc[2:]
        if len(loc) >= 2 and loc[0] == "action" and loc[1] in ("step", "revert", "alert"):
            loc = [loc[0], *loc[2:]]  # the union's tag is noise in the key path
    key = ".".join(loc) or "(rule)"
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        msg = "unknown key"
    elif kind == "missing":
        msg = "required key is missing"
    elif msg.startswith("Value error, "):
        msg = msg.removeprefix("Value error, ")
    elif "input" in err and kind not in ("model_type", "dict_type", "union_tag_invalid"):
        msg = f"{msg} (got {err['input']!r})"
    return f"{name}: {where}: {key}: {msg}"
