#!/usr/bin/env bash
# The demo: a coordinator with a real sglang-router, two node daemons supervising emulated SGLang
# engines, and this process as the trainer. Every engine is refitted to v1; one is SIGKILLed,
# detected, relaunched and kept out of the router until refit v2 syncs it; then a node daemon is
# SIGKILLed and its engines adopted. `bash scripts/demo.sh --node` runs the single-node demo;
# `bash scripts/demo.sh --ray` the GRPO-shaped loop on a local 3-node Ray cluster under churn
# (examples/ray_grpo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
if [ "${1:-}" = "--node" ]; then
  shift
  exec .venv/bin/rollout-watchdog demo "$@"
fi
if [ "${1:-}" = "--ray" ]; then
  shift
  exec .venv/bin/python examples/ray_grpo.py "$@"
fi
exec .venv/bin/rollout-watchdog demo --fleet "$@"
