"""The vLLM child, OS-facing: spawn and reap (`oscalls`), the process state machine (`process`), its
command line and environment (`launch`), vLLM's log lines (`logwatch`), leftovers of an earlier run
(`leftovers`)."""
