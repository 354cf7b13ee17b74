#!/usr/bin/env bash
# The demo: a node daemon supervising emulated SGLang engines on this machine; one engine is
# SIGKILLed, and the timeline shows it detected, cleaned up and relaunched.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
exec .venv/bin/rollout-watchdog demo "$@"
