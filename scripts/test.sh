#!/usr/bin/env bash
# The test suite: installs what it needs, lints, then runs every test (about 3 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
.venv/bin/ruff check rollout_watchdog tests bench
exec .venv/bin/python -m pytest -q "$@"
