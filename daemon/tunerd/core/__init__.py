"""Value types every layer shares; this package imports nothing of tunerd.

Engine parameters and backends (`params`), failure kinds (`failures`), engine states (`states`), exit
decoding (`exits`), byte units (`units`), and the facts the sensors hand to the planner and the policy:
machine and memory facts (`machine`), model facts (`model`), what vLLM reported at a start
(`report`), the published signal names (`signal_catalog`).
"""
