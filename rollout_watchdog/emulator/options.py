"""The emulator's command line (also mounted as the ``rollout-watchdog emulator`` subcommand).

Only argparse and the fault table: building the parser starts nothing.
"""

from __future__ import annotations

import argparse
import os

from rollout_watchdog.emulator import faults, weight_spec
from rollout_watchdog.emulator.common import EMULATED_SGLANG_VERSION, NO_MODEL_ENV, version_tuple


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text!r}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    return value


def _hidden_size(text: str) -> int:
    size = int(text)
    if not 1 <= size <= 16384:
        raise argparse.ArgumentTypeError(f"must be between 1 and 16384, got {size}")
    return size


def _weight_spec(text: str) -> str | weight_spec.Spec:
    try:
        return weight_spec.resolve(text)
    except weight_spec.SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _sglang_version(text: str) -> str:
    try:
        version_tuple(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the emulator's options to ``parser`` (a new one, or a CLI subcommand parser)."""
    if parser is None:
        parser = argparse.ArgumentParser(
            prog="python -m rollout_watchdog.emulator",
            description="SGLang-compatible emulator engine (tiny CPU model, fault injection).",
        )
    parser.add_argument("--port", type=_port, required=True, help="HTTP port (0: any free)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--model-path", default="emulator/tiny", help="reported model path")
    parser.add_argument("--tokenizer-path", default=None, help="reported tokenizer path")
    parser.add_argument("--served-model-name", default=None, help="default: the model path")
    parser.add_argument("--weight-version", default="default", help="initial weight version")
    parser.add_argument(
        "--sglang-version",
        type=_sglang_version,
        default=EMULATED_SGLANG_VERSION,
        help="SGLang release to behave as, reported in /server_info (default "
        f"{EMULATED_SGLANG_VERSION}); below 0.5.21 there is no begin/end_weight_update, below "
        "0.5.22 a flush refused after a weight update kills the server",
    )
    parser.add_argument("--hidden-size", type=_hidden_size, default=64, metavar="N",
                        help="the tiny model's hidden size (default 64, ~50k parameters); "
                        "3584 makes ~100 MB of fp32 weights, for refit benchmarks")
    parser.add_argument(
        "--weight-spec", type=_weight_spec, metavar="tiny|learn|FILE",
        default=os.environ.get(weight_spec.ENV) or weight_spec.TINY,  # argparse applies type
        help="the parameter names and shapes a weight update may carry: tiny = the tiny "
        "model's own (default); learn = whatever the first refit sends, fixed from then on; "
        "FILE = a JSON spec {\"name\": [dims]} (unknown names and wrong shapes fail, as in "
        f"SGLang). Default: ${weight_spec.ENV}, else tiny")
    parser.add_argument(
        "--no-model", action="store_true",
        help="a test and demo speed knob, not SGLang behaviour: build no torch model (an "
        "engine starts on ~0.1 s of CPU instead of ~1.5 s); generation emits placeholder "
        "text, and every weight-update operation is refused with an error naming this flag. "
        f"emulator.testing.emulator_command adds it when ${NO_MODEL_ENV}=1 (the test suite "
        "sets that for test modules that never update weights)")
    parser.add_argument("--enable-metrics", action="store_true", help="serve /metrics")
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="allow /release_memory_occupation and /resume_memory_occupation",
    )
    parser.add_argument(
        "--token-latency-ms",
        type=_nonneg_float,
        default=1.0,
        help="time one decode step (one token per running request) costs (default 1)",
    )
    parser.add_argument(
        "--nccl-port", type=_port, default=None, help="accepted and ignored (server_info)"
    )
    parser.add_argument(
        "--dead-scheduler",
        choices=("exit", "zombie"),
        default="exit",
        help="when the scheduler child dies: exit = tear the server down within ~1 s "
        "(SGLang 0.5.12+); zombie = HTTP keeps answering, generation hangs (older SGLang)",
    )
    group = parser.add_argument_group("fault injection (timers count from 'ready')")
    _add_fault_flags(group)
    # Not faults of a running server: they shape its start.
    group.add_argument("--startup-delay", type=_nonneg_float, default=0.0, metavar="S",
                       help="model load takes S seconds; the port is bound only after it")
    group.add_argument("--exit-code", type=int, default=None, metavar="N",
                       help="exit at once with code N (after --startup-delay, if any)")
    return parser


def _add_fault_flags(group: argparse._ArgumentGroup) -> None:
    """The fault table's start-up flags: ``--NAME`` switches and ``--NAME-after S`` timers."""
    for fault in faults.FAULTS.values():
        if fault.switch == "start":
            group.add_argument(fault.flag, action="store_true", help=fault.does)
        elif fault.switch == "ready":
            group.add_argument(fault.flag, action="store_true", help=f"after ready, {fault.does}")
        if fault.timed:
            group.add_argument(f"{fault.flag}-after", type=_nonneg_float, metavar="S",
                               help=f"{fault.does}, S seconds after ready")
