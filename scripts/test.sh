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

# The first two passes run in the background, each pytest in a process group of its own with
# SIGINT's handler put back (a job started with & has it ignored, and Python keeps it so): a
# Ctrl-C, or an INT or TERM sent to this script, reaches each pass exactly once, through the
# trap, and each ends as pytest ends on a Ctrl-C (its tests torn down). The heavy pass's output
# is shown once it ends (two passes' progress would interleave).
in_own_group() {
    exec .venv/bin/python -c 'import os, signal, sys, pytest
os.setpgrp()
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -q "$@"
}
heavy_log=$(mktemp)
trap 'rm -f "$heavy_log"' EXIT
in_own_group -n 2 --dist loadfile -m heavy "$@" >"$heavy_log" 2>&1 &
heavy=$!
in_own_group -n "${RW_TEST_WORKERS:-4}" -m "not serial and not heavy" "$@" &
first=$!
stopped=0
stop() { stopped=$1; kill -INT -- "-$first" "-$heavy" 2>/dev/null || true; }
trap 'stop 130' INT
trap 'stop 143' TERM
# pass_status PID: its exit status (a trapped signal ends a wait early: waited for again), 0
# for "no test selected" (5)
pass_status() {
    rc=0
    wait "$1" || rc=$?
    while kill -0 "$1" 2>/dev/null; do
        rc=0
        wait "$1" || rc=$?
    done
    [ "$rc" -ne 5 ] || rc=0
}
pass_status "$first"
status=$rc
pass_status "$heavy"
echo "---- the heavy pass (it ran beside the first):"
cat "$heavy_log"
[ "$status" -ne 0 ] || status=$rc
[ "$stopped" -eq 0 ] || exit "$stopped"
trap - INT TERM
.venv/bin/python -m pytest -q -m serial "$@" || { rc=$?; [ "$rc" -eq 5 ] || { [ "$status" -ne 0 ] || status=$rc; }; }
exit "$status"
