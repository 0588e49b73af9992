"""The stateful machines the main loop drives, one step at a time, never blocking.

`lifecycle`: the engine's life (crash-loop breaker, last-known-good, FATAL); `starting`: one start
from the queue to a spawned vLLM; `preflight`: the checks every start passes; `run_guards`: the guards
that watch a run; `capacity`: the planner's verdict and calibration at each start (its I/O edge).
"""
