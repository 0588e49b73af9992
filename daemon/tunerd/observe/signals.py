"""The signal window as the daemon's sensors use it: the class and the catalogue live in `core`
(core/signal_window.py, core/signal_catalog.py), where the policy's trial windows use the same code;
this module keeps the names its callers import and prints the table for docs/signals.md."""

from __future__ import annotations

from tunerd.core.signal_window import (
    EXTRA_COUNTERS,
    KEY_INDICATORS,
    SIGNALS,
    SignalSpec,
    SignalWindow,
    histogram_quantile,
    signals_markdown,
)

__all__ = [
    "EXTRA_COUNTERS",
    "KEY_INDICATORS",
    "SIGNALS",
    "SignalSpec",
    "SignalWindow",
    "histogram_quantile",
    "signals_markdown",
]

if __name__ == "__main__":  # python -m tunerd.observe.signals: print the table for docs/signals.md
    print(signals_markdown(), end="")
