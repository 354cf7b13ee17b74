#!/usr/bin/env bash
# Creates .venv (once) and installs the project with its test extras into it.
# CPU torch: `torch==2.13.0` is pinned first so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# -I: not from the working directory (nor PYTHONPATH); the package must be this checkout's (an
# editable install made from another copy of the tree points there). Each is found, not
# imported (importing torch and ray took ~5 s of every run): a module with a file, not a
# directory left behind (a namespace package); an install cut short leaves no .venv/.installed.
if ! .venv/bin/python -I -c 'import sys
from importlib.util import find_spec
names = "rollout_watchdog torch numpy pdoc pytest zmq psutil mypy importlinter ray".split()
found = [find_spec(name) for name in names]
sys.exit(any(spec is None or spec.origin is None for spec in found)
         or not str(found[0].origin).startswith(sys.argv[1]))' "$PWD/" 2>/dev/null \
   || [ setup.cfg -nt .venv/.installed ]; then
  rm -f .venv/.installed
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e ".[test]"
  touch .venv/.installed
fi
