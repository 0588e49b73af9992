"""The capacity planner: what fits before vLLM tries. Pure arithmetic over core types.

`plan.assess` is the entry point (a `PlanVerdict`), built from `kv_math` (vLLM's KV arithmetic),
`memory_budget` (what vLLM would hand the KV cache), `device_memory` (which memory vLLM sizes against)
and `calibration` (what one start taught about non-KV memory). `report` renders a verdict; `checks` are
the operator's preflight checks. The I/O around it (reading the model and the machine, storing
calibrations) is the caller's: `supervise.capacity`, `cli.plan`.
"""
