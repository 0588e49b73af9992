"""The rules file model: terms, rules and actions validated as data; every problem as
`file: rule NAME: key: reason`, all of a file's problems at once; the shipped playbook loads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tunerd.config import ConfigError
from tunerd.config.rules import (
    AlertAction,
    RevertAction,
    Rule,
    RuleSet,
    StepAction,
    Term,
    load_rules,
    parse_rules,
    parse_term,
)

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = REPO / "etc" / "tunerd" / "rules.toml"
FILE = "rules.toml"
STEP: dict[str, Any] = {"kind": "step", "param": "max_num_seqs", "direction": "down", "factor": 0.5}


def rule(name: str = "r", **changes: Any) -> dict[str, Any]:
    """A valid rule document, changed by `changes` (a value of None removes the key)."""
    doc: dict[str, Any] = {"name": name, "all": ["kv_cache.usage_avg > 0.9"], "action": dict(STEP)}
    doc.update(changes)
    return {key: value for key, value in doc.items() if value is not None}


def problems(*rules: dict[str, Any], extra: dict[str, Any] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_rules({"rule": list(rules), **(extra or {})}, FILE)
    return info.value.problems


def only_problem(*rules: dict[str, Any]) -> str:
    found = problems(*rules)
    assert len(found) == 1, found
    return found[0]


def step(**changes: Any) -> dict[str, Any]:
    doc = {"kind": "step", "param": "max_num_seqs", "direction": "down", **changes}
    return {key: value for key, value in doc.items() if value is not None}


# -- terms -----------------------------------------------------------------------------------------


def test_a_term_against_a_number_parses_to_an_absolute_threshold() -> None:
    assert parse_term("kv_cache.usage_avg > 0.9") == Term("kv_cache.usage_avg", ">", 0.9, relative=False)


def test_a_term_against_a_factor_of_the_baseline_is_relative_with_that_factor() -> None:
    assert parse_term("throughput.generation < 0.7 * baseline") == Term(
        "throughput.generation", "<", 0.7, relative=True
    )


def test_a_term_against_the_bare_baseline_is_relative_with_factor_one() -> None:
    assert parse_term("throughput.generation >= baseline") == Term(
        "throughput.generation", ">=", 1.0, relative=True
    )


@pytest.mark.parametrize("op", ["<", "<=", ">", ">=", "==", "!="])
def test_every_operator_parses(op: str) -> None:
    assert parse_term(f"preemptions.rate {op} 0").op == op


def test_a_term_without_spaces_parses() -> None:
    assert parse_term("preemptions.rate>=2") == Term("preemptions.rate", ">=", 2.0)


@pytest.mark.parametrize(("text", "value"), [("1e3", 1000.0), ("-0.5", -0.5), (".25", 0.25), ("+4", 4.0)])
def test_numbers_in_every_float_spelling_parse(text: str, value: float) -> None:
    assert parse_term(f"host.swap_in_rate > {text}").threshold == value


def test_a_term_prints_back_as_it_reads() -> None:
    assert (
        str(parse_term("throughput.generation <  0.7*baseline")) == "throughput.generation < 0.7 * baseline"
    )
    assert str(parse_term("kv_cache.usage>0.90")) == "kv_cache.usage > 0.9"


def test_an_unknown_signal_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=re.escape("unknown signal 'kv_cache.fullness'")):
        parse_term("kv_cache.fullness > 0.9")


@pytest.mark.parametrize("op", ["=>", "=", "<>", "~"])
def test_a_bad_operator_is_refused(op: str) -> None:
    with pytest.raises(ValueError, match="is not `signal op number`"):
        parse_term(f"kv_cache.usage {op} 0.9")


def test_a_threshold_that_is_not_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="is not `signal op number`"):
        parse_term("kv_cache.usage > high")


def test_a_factor_times_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="a factor multiplies `baseline`"):
        parse_term("kv_cache.usage > 2 * 0.4")


# -- one problem, named by file, rule and key ------------------------------------------------------


def test_a_valid_rule_parses_with_its_defaults() -> None:
    rules = parse_rules({"rule": [rule("kv")]}, FILE).rules
    assert len(rules) == 1
    only = rules[0]
    assert (only.for_s, only.cooldown_s, only.hysteresis, only.purpose) == (120.0, 900.0, 0.05, "performance")
    assert only.combine == "all"
    assert only.terms == (Term("kv_cache.usage_avg", ">", 0.9),)
    assert isinstance(only.action, StepAction)


def test_an_any_rule_combines_with_any() -> None:
    parsed = parse_rules({"rule": [rule(all=None, any=["host.swap_in_rate > 0"])]}, FILE).rules[0]
    assert parsed.combine == "any"


def test_an_empty_document_is_an_empty_rule_set() -> None:
    assert parse_rules({}, FILE).rules == ()


def test_a_bad_threshold_in_a_rule_names_file_rule_and_key() -> None:
    problem = only_problem(rule("kv", all=["kv_cache.usage > high"]))
    assert problem.startswith(f"{FILE}: rule kv: all: ")
    assert "'kv_cache.usage > high'" in problem


def test_an_unknown_signal_in_a_rule_names_file_rule_and_key() -> None:
    problem = only_problem(rule("kv", any=["kv_cache.fullness > 0.9"], all=None))
    assert problem == (
        f"{FILE}: rule kv: any: unknown signal 'kv_cache.fullness' "
        "(the signals are listed in docs/signals.md)"
    )


def test_a_bad_operator_in_a_rule_names_file_rule_and_key() -> None:
    assert only_problem(rule("kv", all=["kv_cache.usage => 0.9"])).startswith(f"{FILE}: rule kv: all: ")


def test_an_unknown_key_in_a_rule_is_an_error() -> None:
    assert only_problem(rule("kv", for_seconds=60)) == f"{FILE}: rule kv: for_seconds: unknown key"


def test_an_unknown_key_in_an_action_is_an_error_keyed_under_action() -> None:
    assert (
        only_problem(rule("kv", action={**STEP, "size": 4})) == f"{FILE}: rule kv: action.size: unknown key"
    )


def test_an_unknown_top_level_key_is_an_error() -> None:
    assert problems(rule(), extra={"rules": []}) == [f"{FILE}: (top level): rules: unknown key"]


def test_a_rule_without_a_name_is_named_by_its_position() -> None:
    assert only_problem(rule("a"), rule(name=None)) == f"{FILE}: rule #2: name: required key is missing"


def test_a_name_that_is_not_a_slug_is_refused() -> None:
    assert only_problem(rule("Bad Name")).startswith(f"{FILE}: rule Bad Name: name: ")


def test_a_wrongly_typed_number_quotes_what_it_got() -> None:
    problem = only_problem(rule("kv", for_s="long"))
    assert problem.startswith(f"{FILE}: rule kv: for_s: ")
    assert "(got 'long')" in problem


def test_a_duplicate_rule_name_is_an_error_that_names_it() -> None:
    problem = only_problem(rule("kv"), rule("kv"))
    assert problem.startswith(f"{FILE}: ")
    assert "'kv' is used twice" in problem


def test_a_duplicate_rule_name_is_reported_against_that_rule_and_its_name_key() -> None:
    assert only_problem(rule("kv"), rule("kv")).startswith(f"{FILE}: rule kv: name: ")


def test_a_duplicate_rule_name_is_reported_beside_the_other_problems() -> None:
    found = problems(rule("kv"), rule("kv"), rule("other", all=["kv_cache.fullness > 1"]))
    assert any("used twice" in line for line in found), found


def test_both_all_and_any_is_an_error() -> None:
    problem = only_problem(rule("kv", any=["host.swap_in_rate > 0"]))
    assert problem == f"{FILE}: rule kv: (rule): give exactly one of all = [...] or any = [...]"


def test_neither_all_nor_any_is_an_error() -> None:
    problem = only_problem(rule("kv", all=None))
    assert problem == f"{FILE}: rule kv: (rule): give exactly one of all = [...] or any = [...]"


def test_an_empty_term_list_is_an_error() -> None:
    assert only_problem(rule("kv", all=[])).startswith(f"{FILE}: rule kv: all: ")


# -- actions ---------------------------------------------------------------------------------------


def test_a_step_with_no_way_to_step_is_an_error() -> None:
    assert only_problem(rule("kv", action=step())) == (
        f"{FILE}: rule kv: action: give exactly one of factor, by, next = true"
    )


@pytest.mark.parametrize(
    "ways", [{"factor": 0.5, "by": 4}, {"by": 4, "next": True}, {"factor": 0.5, "next": True}]
)
def test_a_step_with_two_ways_to_step_is_an_error(ways: dict[str, Any]) -> None:
    assert only_problem(rule("kv", action=step(**ways))) == (
        f"{FILE}: rule kv: action: give exactly one of factor, by, next = true"
    )


def test_a_factor_above_one_going_down_is_an_error() -> None:
    assert only_problem(rule("kv", action=step(factor=2.0))) == (
        f"{FILE}: rule kv: action: factor 2 does not go down: use < 1 down, > 1 up"
    )


def test_a_factor_below_one_going_up_is_an_error() -> None:
    assert only_problem(rule("kv", action=step(direction="up", factor=0.5))) == (
        f"{FILE}: rule kv: action: factor 0.5 does not go up: use < 1 down, > 1 up"
    )


@pytest.mark.parametrize("direction", ["up", "down"])
def test_a_factor_of_one_goes_nowhere_and_is_an_error(direction: str) -> None:
    assert "does not go" in only_problem(rule("kv", action=step(direction=direction, factor=1.0)))


@pytest.mark.parametrize("key", ["factor", "by"])
def test_a_step_size_must_be_positive(key: str) -> None:
    assert only_problem(rule("kv", action=step(**{key: -1}))).startswith(f"{FILE}: rule kv: action.{key}: ")


def test_an_untunable_parameter_is_an_error_keyed_action_param() -> None:
    problem = only_problem(rule("kv", action=step(param="kv_cache_dtype", by=1)))
    assert problem.startswith(f"{FILE}: rule kv: action.param: 'kv_cache_dtype' is not a tunable parameter")


def test_a_bad_direction_is_an_error_keyed_action_direction() -> None:
    problem = only_problem(rule("kv", action=step(direction="sideways", by=1)))
    assert problem.startswith(f"{FILE}: rule kv: action.direction: ")


def test_an_unknown_action_kind_is_an_error_keyed_action() -> None:
    problem = only_problem(rule("kv", action={"kind": "explode"}))
    assert problem.startswith(f"{FILE}: rule kv: action: ")
    assert "'explode'" in problem


def test_a_revert_action_takes_no_parameter() -> None:
    assert only_problem(rule("kv", action={"kind": "revert", "param": "max_num_seqs"})) == (
        f"{FILE}: rule kv: action.param: unknown key"
    )


def test_revert_and_alert_actions_parse() -> None:
    parsed = parse_rules(
        {"rule": [rule("a", action={"kind": "revert"}), rule("b", action={"kind": "alert"})]}, FILE
    ).rules
    assert isinstance(parsed[0].action, RevertAction)
    assert isinstance(parsed[1].action, AlertAction)


@pytest.mark.parametrize("way", [{"factor": 0.5}, {"by": 4}, {"next": True}], ids=["factor", "by", "next"])
def test_a_step_with_exactly_one_way_parses(way: dict[str, Any]) -> None:
    parsed = parse_rules({"rule": [rule("kv", action=step(**way))]}, FILE).rules[0]
    assert isinstance(parsed.action, StepAction)


# -- every problem at once -------------------------------------------------------------------------


def test_every_problem_of_a_file_is_reported_each_naming_file_rule_and_key() -> None:
    found = problems(
        rule("first", all=["kv_cache.usage > high"], colour="red"),
        rule("fine"),
        rule("second", any=["kv_cache.fullness > 1"], all=None, action={"kind": "explode"}),
        rule("third", action=step(direction="up", factor=0.5)),
    )
    assert sorted(found) == sorted(
        [
            f"{FILE}: rule first: all: 'kv_cache.usage > high' is not `signal op number` or "
            "`signal op factor * baseline` (op: < <= > >= == !=)",
            f"{FILE}: rule first: colour: unknown key",
            f"{FILE}: rule second: any: unknown signal 'kv_cache.fullness' (the signals are listed in "
            "docs/signals.md)",
            f"{FILE}: rule second: action: Input tag 'explode' found using 'kind' does not match any of the "
            "expected tags: 'step', 'revert', 'alert'",
            f"{FILE}: rule third: action: factor 0.5 does not go up: use < 1 down, > 1 up",
        ]
    )


def test_every_bad_term_of_one_rule_is_reported() -> None:
    found = problems(rule("kv", all=["kv_cache.usage > high", "kv_cache.fullness > 1"]))
    assert any("kv_cache.usage > high" in line for line in found), found
    assert any("kv_cache.fullness" in line for line in found), found


# -- files -----------------------------------------------------------------------------------------


def test_a_rules_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(
        '[[rule]]\nname = "kv"\nall = ["kv_cache.usage_avg > 0.9", "preemptions.rate > 0"]\n'
        'action = { kind = "step", param = "max_num_seqs", direction = "down", factor = 0.5 }\n'
    )
    loaded = load_rules(str(path))
    assert isinstance(loaded, RuleSet)
    assert [r.name for r in loaded.rules] == ["kv"]


def test_problems_of_a_file_name_the_file_path(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text('[[rule]]\nname = "kv"\nall = ["kv_cache.usage_avg > 0.9"]\naction = { kind = "nope" }\n')
    with pytest.raises(ConfigError) as info:
        load_rules(str(path))
    assert [line.split(": ", 3)[:3] for line in info.value.problems] == [[str(path), "rule kv", "action"]]


def test_a_toml_syntax_error_is_one_problem_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text("[[rule]\nname = \n")
    with pytest.raises(ConfigError) as info:
        load_rules(str(path))
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(f"{path}: (syntax): ")


def test_a_missing_file_is_one_problem_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_rules(str(path))
    assert len(info.value.problems) == 1
    assert info.value.problems[0].startswith(f"{path}: (file): cannot read: ")


def test_the_shipped_playbook_loads() -> None:
    assert PLAYBOOK.is_file(), f"{PLAYBOOK} is shipped and must exist"
    loaded = load_rules(str(PLAYBOOK))
    assert loaded.rules, "the shipped playbook has rules"
    for parsed in loaded.rules:
        assert isinstance(parsed, Rule)
        assert parsed.terms, parsed.name


@pytest.mark.parametrize(
    ("changes", "key", "got"),
    [
        ({"for_s": True}, "for_s", "(got True)"),  # a boolean is no duration
        ({"for_s": "60"}, "for_s", "(got '60')"),  # a string is no number
        ({"why": 3}, "why", "(got 3)"),  # a number is no string
        ({"action": step(next="true")}, "action.next", "(got 'true')"),  # a string is no boolean
        ({"action": step(by=True)}, "action.by", "(got True)"),
    ],
)
def test_a_value_of_the_wrong_toml_type_is_refused_with_its_key(
    changes: dict[str, Any], key: str, got: str
) -> None:
    problem = only_problem(rule("typed", **changes))
    assert problem.startswith(f"{FILE}: rule typed: {key}: "), problem
    assert got in problem


def test_an_integer_stands_for_a_float_in_a_rule() -> None:
    (parsed,) = parse_rules({"rule": [rule("r", for_s=60, action=step(factor=None, by=4))]}, FILE).rules
    assert parsed.for_s == 60.0 and isinstance(parsed.action, StepAction) and parsed.action.by == 4.0


def test_the_shipped_attainment_rule_only_alerts_and_reads_the_doors_signals() -> None:
    # Rules may name the per-request signals; the shipped one on attainment never restarts vLLM.
    (rule,) = [r for r in load_rules(str(PLAYBOOK)).rules if r.name == "slo-attainment-below-target"]
    assert rule.action.kind == "alert"
    assert {t.signal for t in rule.terms} == {"slo.attainment", "slo.requests"}
    for name in (
        "slo.goodput",
        "slo.attainment.ttft",
        "slo.attainment.tpot",
        "door.ttft.p95",
        "door.waiting",
    ):
        assert parse_term(f"{name} > 0").signal == name
