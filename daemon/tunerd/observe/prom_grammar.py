"""The Prometheus text exposition grammar as prometheus_client's parser accepts it, as regular expressions.

Used by `vllm_metrics.extract` to reject exactly the garbage the full parser rejects, without its cost.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import MappingProxyType


class MetricsParseError(ValueError):
    """The text is not Prometheus text exposition (or is truncated); the message says where."""


NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*+"
_QUOTED = r'"[^"\\\n]*+(?:\\.[^"\\\n]*+)*+"'
# What float() accepts without underscores (prometheus_client's _parse_value), ASCII digits only.
FLOAT = (
    r"[+-]?+(?:(?:[0-9]++(?:\.[0-9]*+)?+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+"
    r"|[iI][nN][fF](?:[iI][nN][iI][tT][yY])?+|[nN][aA][nN])"
)
WS = r"[ \t\r\f\v]*+"  # what str.strip() removes at either end of a line (ASCII part)
_VALUE_TAIL = rf"[ \t]++{FLOAT}(?:[ \t]++{FLOAT})?+{WS}"
_TYPES = "counter|gauge|histogram|summary|untyped|unknown|info|stateset|gaugehistogram"  # metrics_core
_COMMENT = (
    rf"\#(?:[ \t]++(?:HELP(?:[ \t]++(?:{NAME}|{_QUOTED})(?:[ \t][^\n]*+)?+)?+{WS}"
    rf"|TYPE[ \t]++(?:{NAME}|{_QUOTED})[ \t]++(?:{_TYPES}){WS})"
    rf"|(?![ \t]++(?:TYPE|HELP)(?:\s|$))[^\n]*+)"
)
# Labels as prometheus_client's parse_labels accepts them: legacy or quoted names (no reserved "__"
# prefix), quoted values with escapes, optional leading/trailing comma. `PLAIN_LABEL`, a subset, is the
# form vLLM writes (no escapes, names not starting with "_"); tried first because it is cheaper.
_LABEL_NAME = rf"(?!__)(?:{NAME}|{_QUOTED})"
_LABEL = rf"[ \t]*+{_LABEL_NAME}[ \t]*+=[ \t]*+{_QUOTED}[ \t]*+"
LABELS = rf"[ \t]*+,?+(?:{_LABEL}(?:,{_LABEL})*+,?+)?+[ \t]*+"
_LABELS_RE = re.compile(LABELS)
PLAIN_LABEL = r'[a-zA-Z:][a-zA-Z0-9_:]*+="[^"\\\n]*+"'
_SAMPLE = rf"{NAME}(?:\{{{PLAIN_LABEL}(?:,{PLAIN_LABEL})*+\}}|\{{{LABELS}\}})?+{_VALUE_TAIL}"
# Sample lines first, comments next (half the lines), leading whitespace last: it never occurs in vLLM's
# output, but the full parser strips it.
LINE = rf"(?:{_SAMPLE}|{_COMMENT}|{WS}(?:{_COMMENT}|{_SAMPLE})?+)\n"
_LABEL_PAIR_RE = re.compile(rf'[ \t]*+({_LABEL_NAME})[ \t]*+=[ \t]*+"([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"')
_ESCAPE_RE = re.compile(r'\\[\\n"]')
_ESCAPES = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


def alternation(words: list[str]) -> str:
    """A regex matching one of `words`, factored into a prefix tree: a line of an unwanted family
    fails after a few characters instead of after trying each of ~40 names in turn."""
    prefix = os.path.commonprefix(words)  # noqa: RUF071 (a character prefix is what is wanted)
    rests = [w[len(prefix) :] for w in words]
    if rests == [""]:
        return re.escape(prefix)
    by_first: dict[str, list[str]] = {}
    for rest in rests:
        if rest:
            by_first.setdefault(rest[0], []).append(rest)
    branches = "|".join(alternation(group) for _, group in sorted(by_first.items()))
    optional = "?" if "" in rests else ""
    return f"{re.escape(prefix)}(?:{branches}){optional}"


# Parsed label strings, keyed by the raw text between the braces. Cleared when they pile up.
_LABEL_CACHE: dict[str, Mapping[str, str]] = {}
_CACHE_MAX = 4096


def _unescape(value: str) -> str:
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], value) if "\\" in value else value


def parse_labels(raw: str) -> Mapping[str, str]:
    labels = _LABEL_CACHE.get(raw)
    if labels is None:
        if _LABELS_RE.fullmatch(raw) is None:
            raise MetricsParseError(f"unparsable labels {{{raw[:100]}}}")
        pairs = [
            (_unescape(n[1:-1]) if n[0] == '"' else n, _unescape(v)) for n, v in _LABEL_PAIR_RE.findall(raw)
        ]
        parsed = dict(pairs)
        if len(parsed) != len(pairs):
            raise MetricsParseError(f"duplicate label name in {{{raw}}}")
        if len(_LABEL_CACHE) >= _CACHE_MAX:
            _LABEL_CACHE.clear()
        labels = _LABEL_CACHE[raw] = MappingProxyType(parsed)
    return labels


def bucket_bound(name: str, raw_labels: str) -> float:
    le = parse_labels(raw_labels).get("le")
    if le is None:
        raise MetricsParseError(f"{name} line without an le label")
    try:
        return float(le)
    except ValueError:
        raise MetricsParseError(f"{name} line with unparsable le={le!r}") from None
