"""The tuning loop, above `supervise/` (it uses the lifecycle's public face, never the reverse).

`tuner`: rules fire, one verified change at a time; `explorer`: the coordinate search and its triggers;
`recall`: what a known configuration served before; `prober`: the synthetic load; `memory`: what
tuning remembers (tabu, mutes, budget, kept changes).
"""
