"""How the daemon shows itself: its HTTP endpoint (`http`: read-only /metrics and /status), the status
document (`status`, built from a snapshot), systemd notifications (`systemd`) and logging (`logs`)."""
