"""The engine's life, one step at a time, never blocking; imports nothing of `tune/`.

`lifecycle`: the crash-loop breaker, last-known-good, FATAL; `change`: the change slot (one change in
flight, its outcome posted on the loop's queue); `drain`: the door's drain before a planned stop;
`starting`: one start from the queue to a
spawned vLLM; `preflight`: the checks every start passes; `run_guards`: the guards that watch a run;
`capacity`: the planner's verdict and calibration at each start (its I/O edge); `door_link`: the front
door's view of the engine; `cache_reset`: the off-peak prefix-cache reset.
"""
