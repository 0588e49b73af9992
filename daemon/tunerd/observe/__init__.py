"""Sensors only, never decisions: vLLM's /metrics (`vllm_metrics`) and /health (`health`), NVML (`gpu`),
host memory (`host`, `memory`), the machine (`machine_facts`), the model directory (`model`), identity
and capability probes (`identity`), the once-a-second poll (`poller`), the scheduler jobs (`jobs`) and
the signal window (`signals`, over the catalogue `core.signal_catalog`)."""
