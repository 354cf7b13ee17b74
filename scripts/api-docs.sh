#!/usr/bin/env bash
# The Python API reference, from the docstrings: writes docs/api/ (or the directory given),
# open docs/api/index.html. The public modules only: the names exported from rollout_watchdog,
# the refit handle that fleet.refit() returns, and the emulator's entry points.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-docs/api}
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" -m pdoc --docformat markdown -o "$OUT" \
  rollout_watchdog rollout_watchdog.refit_bridge.refit rollout_watchdog.emulator \
  '!rollout_watchdog\.(?!emulator$|refit_bridge$|refit_bridge\.refit$).*'
