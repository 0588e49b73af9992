"""The `tunerd` command line: `main` parses and dispatches; `plan`, `status`, `journal` render."""

from tunerd.cli.main import main

__all__ = ["main"]
