"""The shipped etc/tunerd/tunerd.toml is valid and documents every key the daemon accepts."""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from tunerd.config import Config, load_config, parse_config
from tunerd.config.rules import load_rules
from tunerd.core.params import EngineParams

SHIPPED = Path(__file__).resolve().parents[2] / "etc" / "tunerd" / "tunerd.toml"


def leaf_keys(model: type[BaseModel], prefix: str = "") -> Iterator[str]:
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if (
            isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
            and annotation is not EngineParams
        ):
            yield from leaf_keys(annotation, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_shipped_config_is_valid() -> None:
    load_config(SHIPPED)


def test_every_key_is_documented_in_its_section() -> None:
    text = SHIPPED.read_text()
    sections = {m.group(1): m.end() for m in re.finditer(r"^\[([\w.]+)\]", text, re.M)}
    missing = []
    for key in leaf_keys(Config):
        section, _, name = key.rpartition(".")
        if section and section not in sections:
            missing.append(key)
            continue
        body = text[sections.get(section, 0) :]
        body = body[: m.start()] if (m := re.search(r"^\[", body[1:], re.M)) else body
        if name in ("params", "env"):  # documented as tables of their own
            if f"[{key}]" not in text:
                missing.append(key)
        elif not re.search(rf"^#?\s*{re.escape(name)}\s*=", body, re.M):
            missing.append(key)
    assert not missing, f"keys without a documented default in {SHIPPED}: {missing}"


def test_every_engine_parameter_is_shown() -> None:
    text = SHIPPED.read_text()
    for name in EngineParams.model_fields:
        assert re.search(rf"^#\s*{name}\s*=", text, re.M), name


def commented_examples(text: str) -> Iterator[tuple[str, str]]:
    """(section, `key = value`) for each commented-out example in the shipped file."""
    section = ""
    for line in text.splitlines():
        if header := re.match(r"^\[([\w.]+)\]", line):
            section = header.group(1)
        elif re.match(r"^#\s?[a-z_]+ = ", line):
            yield section, line.lstrip("# ")


def test_every_commented_example_has_the_type_the_config_takes() -> None:
    # The config is strict about TOML types (a boolean is no count): an example an operator uncomments
    # must load as written.
    text = SHIPPED.read_text()
    shipped = tomllib.loads(text)
    examples = list(commented_examples(text))
    assert len(examples) > 10
    for section, line in examples:
        data = copy.deepcopy(shipped)
        table = data
        for part in section.split("."):
            table = table.setdefault(part, {})
        table.update(tomllib.loads(line))
        parse_config(data, f"{SHIPPED} with [{section}] {line}")


def test_the_shipped_rules_load() -> None:
    assert load_rules(str(SHIPPED.parent / "rules.toml")).rules
