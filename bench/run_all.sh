#!/usr/bin/env bash
# Run every benchmark against real vLLM on this machine, then write docs/benchmarks.md and its plots.
#
#   bash bench/run_all.sh            # everything (planned under 2 hours on 2 CPU cores, and over it now:
#                                    # the goodput proof took 101 min on 2026-12-05 before open-mid and
#                                    # the held contenders, ~45 min more; the rest ~25 min on 2026-12-02;
#                                    # not yet timed end to end)
#   bash bench/run_all.sh --quick    # fewer points, short windows: every path; writes under
#                                    # $TMPDIR/tunerd-bench-quick, not docs/. Timed 2026-12-05 on 2 cores:
#                                    # 17 min 06 s, rc 0 (goodput_proof 10 min of it; 25:39 before its
#                                    # quick run shrank); poll_cost read the idle daemon at 1.10 % of a
#                                    # core (budget 1.5 %; 1.50-2.15 % before 8327f41)
#
# Needs the repository's .venv with vLLM (bash scripts/test.sh or scripts/quickstart.sh makes it);
# installs the plotting extra (matplotlib) into it when missing. Run nothing else heavy beside it: every
# figure is a ratio measured side by side on this machine, and another load skews both sides unevenly.
# Each benchmark's output is kept as DIR/NAME.txt (its command on the first line); a benchmark that
# misses its target exits 1, is reported at the end, and does not stop the others.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"

quick=0
[ "${1:-}" = --quick ] && quick=1
py=.venv/bin/python
if [ ! -x "$py" ]; then
    echo "run_all: no .venv here; make it first: bash scripts/test.sh (or scripts/quickstart.sh)" >&2
    exit 2
fi
"$py" -c "import vllm" 2>/dev/null || { echo "run_all: vLLM is not installed in .venv" >&2; exit 2; }
"$py" -c "import matplotlib" 2>/dev/null || .venv/bin/pip install -q -e ".[bench]" || exit 2

if [ $quick = 1 ]; then
    out=${TMPDIR:-/tmp}/tunerd-bench-quick
    page=$out/benchmarks.md
else
    out=docs/benchmarks
    page=docs/benchmarks.md
fi
mkdir -p "$out"
failed=()

# bench NAME ARGS...: run bench/NAME.py, its output to the terminal and to $out/NAME.txt.
bench() {
    local name=$1
    shift
    echo "==> $name $* ($(date -u +%H:%M) UTC)"
    { echo ".venv/bin/python bench/$name.py $*"; "$py" "bench/$name.py" "$@" 2>&1; } | tee "$out/$name.txt"
    local status=${PIPESTATUS[0]}
    [ "$status" = 0 ] || failed+=("$name (exit $status)")
}

began=$(date +%s)
if [ $quick = 1 ]; then
    bench goodput_proof --quick --out "$out/goodput.json"
    bench restart_scaling --landscapes 20 --out "$out/restart_scaling.json"
    bench restart_cost --repeats 1 --no-warm
    bench detection_latency --real --repeats 1
    bench poll_cost --polls 50 --daemon-seconds 20
    bench planner_accuracy --quick
else
    bench goodput_proof --out "$out/goodput.json"
    bench restart_scaling --out "$out/restart_scaling.json"
    bench restart_cost --repeats 3
    bench detection_latency --real --repeats 3
    bench poll_cost
    bench planner_accuracy
fi
"$py" bench/report.py --dir "$out" --page "$page" || failed+=("report")
echo "==> done in $((($(date +%s) - began) / 60)) min; the page: $page"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'missed or failed: %s\n' "${failed[@]}"
    exit 1
fi
