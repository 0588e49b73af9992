"""Plain readers of a procfs tree, shared by the engine (finding its processes) and the sensors.

`processes`: per-process stat/statm/environ, process groups and trees; `memory`: /proc/meminfo and the
page-cache figure, /proc/vmstat, /proc/pressure/memory. Every function takes the procfs root
(`proc="/proc"`), so tests pass a fake tree.
"""
