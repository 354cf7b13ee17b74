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
run() { .venv/bin/python -m pytest -q "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
# The heavy pass's output is shown once it ends (two passes' progress would interleave). A job
# started with & has SIGINT ignored, and Python keeps it so: the pass puts Python's handler
# back, so that a Ctrl-C (the terminal's, or the script's, passed on) ends it cleanly too.
heavy_log=$(mktemp)
trap 'rm -f "$heavy_log"' EXIT
.venv/bin/python -c 'import signal, sys, pytest
signal.signal(signal.SIGINT, signal.default_int_handler)
sys.exit(pytest.main(sys.argv[1:]))' -q -n 2 --dist loadfile -m heavy "$@" >"$heavy_log" 2>&1 &
heavy=$!
interrupted=0
trap 'interrupted=1; kill -INT "$heavy" 2>/dev/null || true' INT TERM
status=0
run -n "${RW_TEST_WORKERS:-4}" -m "not serial and not heavy" "$@" || status=$?
heavy_status=0
wait "$heavy" || heavy_status=$?
while kill -0 "$heavy" 2>/dev/null; do   # (a trapped signal ends a wait early)
    wait "$heavy" || heavy_status=$?
done
[ "$heavy_status" -ne 5 ] || heavy_status=0
echo "---- the heavy pass (it ran beside the first):"
cat "$heavy_log"
[ "$status" -ne 0 ] || status=$heavy_status
[ "$interrupted" -eq 0 ] || exit 130
run -m serial "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
