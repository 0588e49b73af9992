"""What tunerd writes down: the durable journal (`journal`, written through `recorder`), the state
file (`state`), planner calibrations (`calibrations`), atomic writes (`durable`) and tunerd's own
Prometheus metrics (`metrics`)."""
