#!/usr/bin/env bash
# The test suite: installs what it needs, lints and type-checks, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/ruff check rollout_watchdog tests bench examples
.venv/bin/mypy   # strict for the node daemon (pyproject.toml)
.venv/bin/lint-imports   # the layering (setup.cfg, [importlinter])
# Three passes (tests/conftest.py marks them). Most tests on ${RW_TEST_WORKERS:-4} xdist workers
# (4: with --no-model engines the pass waits more than it computes); beside them, at the same
# time, those marked `heavy` (a Ray cluster, the demos, the examples) on 2 workers, a module to
# a worker (test_ray_fleet's cluster is set up once): they mostly wait (a cluster coming up, a
# fault's deadline), and the first pass fills the cores meanwhile; then those marked `serial`
# (floods, bounds another worker's load would blur) one at a time, alone. Every pass runs; the
# first failure's status is the script's. Exit status 5 of a pass means "$@" selected none of
# its tests.

# Each pass runs as a job of its own (`set -m`: its own process group, made before its pid is
# known, and SIGINT not ignored in it, as it is in a plain background job), so that a Ctrl-C, or
# an INT, TERM or HUP sent to this script, reaches each running pass exactly once, through the
# trap, and each ends as pytest ends on a Ctrl-C (its tests torn down); the script then exits
# 130, 143 or 129. The heavy pass's output is shown once it ends (two passes' progress would
# interleave).
heavy_log=$(mktemp)
trap 'rm -f "$heavy_log"' EXIT
running=()
stopped=0
stop() {
    stopped=$1
    for pid in ${running[@]+"${running[@]}"}; do kill -INT -- "-$pid" 2>/dev/null || true; done
}
trap 'stop 130' INT
trap 'stop 143' TERM
trap 'stop 129' HUP
# pass_status PID: its exit status in $rc (a trapped signal ends a wait early: waited for
# again), 0 for "no test selected" (5)
pass_status() {
    rc=0
    wait "$1" || rc=$?
    while kill -0 "$1" 2>/dev/null; do
        rc=0
        wait "$1" || rc=$?
    done
    [ "$rc" -ne 5 ] || rc=0
}
set -m
.venv/bin/python -m pytest -q -n 2 --dist loadfile -m heavy "$@" >"$heavy_log" 2>&1 &
heavy=$!
running+=("$heavy")
.venv/bin/python -m pytest -q -n "${RW_TEST_WORKERS:-4}" -m "not serial and not heavy" "$@" &
first=$!
running+=("$first")
set +m
pass_status "$first"
status=$rc
pass_status "$heavy"
echo "---- the heavy pass (it ran beside the first):"
cat "$heavy_log"
[ "$status" -ne 0 ] || status=$rc
[ "$stopped" -eq 0 ] || exit "$stopped"
set -m
.venv/bin/python -m pytest -q -m serial "$@" &
serial=$!
running=("$serial")
set +m
pass_status "$serial"
[ "$status" -ne 0 ] || status=$rc
[ "$stopped" -eq 0 ] || exit "$stopped"
exit "$status"
