"""Pure decisions over core types, config values and `now`: no I/O, no clocks, no processes.

`restart`: what to do after a failure (retry, correct, roll back, FATAL); `guards`: host-memory
emergency, the memory-return gate, forward progress.
"""
