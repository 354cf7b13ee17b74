#!/usr/bin/env bash
# The demo: a coordinator with a real sglang-router, two node daemons supervising emulated SGLang
# engines, and this process as the trainer. Every engine is refitted to v1; one is SIGKILLed,
# detected, relaunched and kept out of the router until refit v2 syncs it; then a node daemon is
# SIGKILLed and its engines adopted. `bash scripts/demo.sh --node` runs the single-node demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
if [ "${1:-}" = "--node" ]; then
  shift
  exec .venv/bin/rollout-watchdog demo "$@"
fi
exec .venv/bin/rollout-watchdog demo --fleet "$@"
