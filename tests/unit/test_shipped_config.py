"""The shipped etc/tunerd/tunerd.toml is valid and documents every key the daemon accepts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel

from tunerd.config import Config, load_config
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
