"""SGLang-compatible emulator engine for tests and CI without GPUs.

``python -m rollout_watchdog.emulator --port P [options]`` (or ``rollout-watchdog emulator``)
starts an HTTP server with SGLang 0.5.23's endpoints, a scheduler child process running a tiny
torch model, and fault injection (start-up flags and ``POST /_emulator/fault``).

``--weight-spec tiny|learn|FILE`` sets which parameter names and shapes a weight update may carry:
the tiny model's own, whatever the first refit sends, or a JSON spec written by
:func:`write_weight_spec` from the user's own model (see :mod:`.weight_spec`).

This package is imported by the scheduler child too, so it stays light: the server module is
loaded only when run, and torch only inside the scheduler child.
"""

from __future__ import annotations

import argparse

from rollout_watchdog.emulator.weight_spec import write_weight_spec

__all__ = ["build_parser", "main", "run", "write_weight_spec"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the emulator's options to ``parser`` (or a new parser); see options.build_parser."""
    from rollout_watchdog.emulator.options import build_parser as _build_parser

    return _build_parser(parser)


def run(args: argparse.Namespace) -> int:
    """Run the emulator with parsed arguments (see server.run)."""
    from rollout_watchdog.emulator.server import run as _run

    return _run(args)


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: sys.argv[1:]) and run the emulator."""
    return run(build_parser().parse_args(argv))
