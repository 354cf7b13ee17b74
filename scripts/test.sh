#!/usr/bin/env bash
# The test suite: installs what it needs, lints and type-checks, then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/ruff check rollout_watchdog tests bench examples
.venv/bin/mypy   # strict for the node daemon (pyproject.toml)
.venv/bin/lint-imports   # the layering (setup.cfg, [importlinter])
# Two passes: most tests on ${RW_TEST_WORKERS:-2} xdist workers, then those marked `serial`
# (tests/conftest.py: they load the whole machine, or measure what another worker would blur)
# one at a time. Both passes run; the first failure's status is the script's. Exit status 5
# of a pass means "$@" selected none of its tests.
run() { .venv/bin/python -m pytest -q "$@" || { rc=$?; [ "$rc" -eq 5 ] || return "$rc"; }; }
status=0
run -n "${RW_TEST_WORKERS:-2}" -m "not serial" "$@" || status=$?
run -m serial "$@" || { rc=$?; [ "$status" -ne 0 ] || status=$rc; }
exit "$status"
