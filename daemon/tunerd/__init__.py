"""tunerd: supervise one vLLM server and tune its parameters while it runs."""

__version__ = "0.1.0"
