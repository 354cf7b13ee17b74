#!/usr/bin/env bash
# The test suite: installs what it needs, lints, then runs every test (and type-checks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
# Bytecode is cached (a machine may set PYTHONDONTWRITEBYTECODE): the suite starts ~180 daemons,
# hundreds of engines and CLI calls, and each would compile this package from source again, and
# every pass's workers rewrite the test modules' asserts again (6 s a collection). Measured, the
# first pass alternated: 182 and 185 s, 291 and 283 s of CPU, against 192 and 191 s, 303 and 313.
unset PYTHONDONTWRITEBYTECODE
.venv/bin/ruff check rollout_watchdog tests bench examples
.venv/bin/lint-imports   # the layering (setup.cfg, [importlinter])
# mypy (strict for the node daemon, pyproject.toml) runs beside the first pass, its report and
# status taken after it: without its cache, as in a fresh clone, it takes ~38 s of one core
# (it reads 1,384 of torch's files and 818 of ray's), half of which the busy pass absorbs.
mypy_report=$(mktemp)
mypy_pid=
trap 'if [ -n "$mypy_pid" ]; then kill "$mypy_pid" 2>/dev/null || true; fi; rm -f "$mypy_report"' EXIT
.venv/bin/mypy >"$mypy_report" 2>&1 &
mypy_pid=$!
# Three passes (tests/conftest.py marks them): most tests on ${RW_TEST_WORKERS:-6} xdist workers (6:
# the pass waits on engines and deadlines as much as it computes; alternated on 2 cores, 6
# workers took 214 and 266 s against 4's 249 and 297 s, and 8 took 278 s: bench/README.md);
# then those marked `heavy` (a Ray cluster, the demos, the examples) on 3 workers, test_ray_fleet
# whole on one (its cluster is set up once), the others each alone, longest first (conftest.py's
# HeavyScheduling); then those marked `serial` (floods, bounds the main pass's load would blur)
# two at a time: alone they kept under half a core busy (61 s, 25 s of CPU; two at a time 34 s,
# 29 s of CPU, and 17 runs of three at a time all passed). Every pass runs; the first failure's
# status is the script's. Exit status 5 of a pass means "$@" selected none of its tests.
run() { .venv/bin/python -m pytest -q "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
status=0
run -n "${RW_TEST_WORKERS:-6}" -m "not serial and not heavy" "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
mypy_pid=
cat "$mypy_report"
[ "$status" -ne 0 ] || status=$mypy_status
run -n 3 -m heavy "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
run -n 2 -m serial "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
