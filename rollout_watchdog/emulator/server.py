"""Main process of the emulator: HTTP server plus tokenizer-manager stand-in.

The process model mirrors SGLang's: this process serves HTTP (stdlib ThreadingHTTPServer) and
spawns a scheduler child (multiprocessing "spawn") that runs a tiny torch model. Requests go to
the scheduler over a pipe; a dispatcher thread resolves them as token outputs come back. Torch is
never imported here, so the main process stays light.

Behaviour follows SGLang 0.5.23 (see ``shared/SGLANG.md``): same paths, bodies, status codes and
blocking behaviour, including the deliberate "forever" waits (paused requests, control calls on a
stuck scheduler). Every other wait is bounded. Fault injection is available as start-up flags and
through the private endpoint ``POST /_emulator/fault``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import multiprocessing
import os
import queue
import select
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from rollout_watchdog.emulator import scheduler as scheduler_mod
from rollout_watchdog.emulator.common import (
    CONTEXT_LENGTH,
    EMULATED_SGLANG_VERSION,
    HEALTH_CHECK_RID_PREFIX,
    ORPHAN_MARKER,
    SHARED_SLOTS,
    SLOT_GEN_THROUGHPUT,
    SLOT_IGNORE_SIGTERM,
    SLOT_NUM_QUEUE,
    SLOT_NUM_RUNNING,
    SLOT_STALL,
    SLOT_TOKEN_LATENCY_MS,
    VOCAB_SIZE,
    decode,
    encode,
)

STARTING, UP, UNHEALTHY = "Starting", "Up", "UnHealthy"
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
DEFAULT_MAX_NEW_TOKENS = 16
MAX_BODY_BYTES = 64 * 1024 * 1024
SCHEDULER_LOAD_TIMEOUT_S = 300.0  # on top of --startup-delay
WARMUP_TIMEOUT_S = 600.0
CHILD_POLL_INTERVAL_S = 1.0  # SGLang 0.5.12+ polls its children every second
ORPHAN_CODE = "import time\nwhile True:\n    time.sleep(1)\n"
FAULTS = (
    "crash",
    "crash_scheduler",
    "hang_http",
    "stall_generation",
    "unstall",
    "ignore_sigterm",
    "honor_sigterm",
    "orphan",
    "exit",
    "token_latency",
)
FLUSH_CACHE_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

_FOREVER = threading.Event()  # never set: waited on by deliberately endless blocks


def _log(msg: str) -> None:
    # Also called from signal handlers: a re-entrant write to stderr must not raise.
    with contextlib.suppress(RuntimeError, OSError, ValueError):
        print(f"[emulator {os.getpid()}] {msg}", file=sys.stderr, flush=True)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def _env_bool(name: str, default: str) -> bool:
    """Same parsing as SGLang's get_bool_env_var: only "true"/"1" are true."""
    return os.environ.get(name, default).strip().lower() in ("true", "1")


class BadRequest(Exception):
    """A client error answered with 400.

    ``validation`` selects FastAPI's validation-error body (``{"object": "error", ...}``);
    otherwise SGLang's ``{"error": {"message"}}`` body for errors raised by the handler.
    """

    def __init__(self, message: str, validation: bool = False, code: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.validation = validation
        self.code = code


class ClientGone(Exception):
    """The HTTP client disconnected while its request was in flight."""


@dataclass
class ReqState:
    """A request known to the main process (SGLang's rid_to_state entry)."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    is_health: bool = False
    created: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None
    e2e_latency: float = 0.0
    submitted: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    updated: threading.Event = field(default_factory=threading.Event)


# ---- command line ------------------------------------------------------------------------


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
    faults = parser.add_argument_group("fault injection (timers count from 'ready')")
    faults.add_argument("--crash-after", type=_nonneg_float, metavar="S",
                        help="SIGKILL the main process S seconds after ready")
    faults.add_argument("--crash-scheduler-after", type=_nonneg_float, metavar="S",
                        help="SIGKILL the scheduler child S seconds after ready")
    faults.add_argument("--hang-http", action="store_true",
                        help="after ready, every HTTP request blocks forever")
    faults.add_argument("--hang-http-after", type=_nonneg_float, metavar="S",
                        help="start hanging HTTP S seconds after ready")
    faults.add_argument("--stall-generation", action="store_true",
                        help="after ready, the scheduler stops producing output")
    faults.add_argument("--stall-generation-after", type=_nonneg_float, metavar="S",
                        help="stall generation S seconds after ready")
    faults.add_argument("--startup-delay", type=_nonneg_float, default=0.0, metavar="S",
                        help="model load takes S seconds; the port is bound only after it")
    faults.add_argument("--exit-code", type=int, default=None, metavar="N",
                        help="exit at once with code N (after --startup-delay, if any)")
    faults.add_argument("--ignore-sigterm", action="store_true",
                        help="main process and scheduler ignore SIGTERM")
    faults.add_argument("--orphan", action="store_true",
                        help="after ready, leave a child in its own session that outlives us")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the emulator until it exits; returns only for --exit-code (other exits are
    ``os._exit``, like a server process that tears itself down)."""
    if args.exit_code is not None:
        if args.startup_delay:
            time.sleep(args.startup_delay)
        return int(args.exit_code)
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("the emulator must run in the main thread (signals, PDEATHSIG)")
    return EmulatorServer(args).serve()


def main(argv: list[str] | None = None) -> int:
    """``python -m rollout_watchdog.emulator`` entry point."""
    return run(build_parser().parse_args(argv))


# ---- the engine (tokenizer manager + process supervision) --------------------------------


class EmulatorServer:
    """State of the main process: requests, pause, health, faults, scheduler supervision."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.health_timeout = _env_float("SGLANG_HEALTH_CHECK_TIMEOUT", 20.0)
        self.health_generation = _env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        self.force_shutdown = _env_bool("SGL_FORCE_SHUTDOWN", "false")
        self.served_model_name = args.served_model_name or args.model_path
        self.weight_version: str = args.weight_version
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.rid_to_state: dict[str, ReqState] = {}
        self.inflight = 0  # submitted, unfinished, non-health requests (SGLang's reader lock)
        self.responding = 0  # /generate handlers that have not finished writing their answer
        self.is_pause = False
        self.status = STARTING
        self.serving = False
        self.gracefully_exit = False
        self.stopping = False
        self.last_receive_ts = 0.0
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.num_requests_total = 0
        self.memory_released: set[str] = set()
        self.hang_http = False
        self.ignore_sigterm = bool(args.ignore_sigterm)
        self.orphans: list[subprocess.Popen[bytes]] = []
        self.timers: list[tuple[float, str, dict[str, Any]]] = []
        self.wake = threading.Event()
        self.ctx = multiprocessing.get_context("spawn")
        self.shared: Any = self.ctx.RawArray("d", SHARED_SLOTS)
        self.shared[SLOT_TOKEN_LATENCY_MS] = float(args.token_latency_ms)
        self.shared[SLOT_IGNORE_SIGTERM] = 1.0 if self.ignore_sigterm else 0.0
        self.send_queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.ctl_ids = itertools.count(1)
        self.ctl: dict[int, list[Any]] = {}
        self.proc: Any = None
        self.to_sched: Any = None
        self.from_sched: Any = None
        self.scheduler_info: dict[str, Any] = {}
        self.httpd: EmulatorHTTPServer | None = None
        self.port = int(args.port)
        self.zombie_logged = False
        self.hang_logged = False

    # ---- lifecycle ------------------------------------------------------------------------

    def serve(self) -> int:
        """Start everything, then supervise from the main thread until exit."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGQUIT, self._on_sigquit)
        signal.signal(signal.SIGINT, self._on_sigint)
        self._start_scheduler()
        self._wait_scheduler_ready()
        threading.Thread(target=self._dispatch_loop, name="dispatcher", daemon=True).start()
        threading.Thread(target=self._send_loop, name="sender", daemon=True).start()
        self._bind_http()
        threading.Thread(target=self._warm_up, name="warmup", daemon=True).start()
        self._main_loop()
        return 0  # not reached

    def _start_scheduler(self) -> None:
        to_r, to_w = self.ctx.Pipe(duplex=False)
        from_r, from_w = self.ctx.Pipe(duplex=False)
        config = {
            "parent_pid": os.getpid(),
            "startup_delay": float(self.args.startup_delay),
        }
        self.proc = self.ctx.Process(
            target=scheduler_mod.run_scheduler,
            args=(to_r, from_w, config, self.shared),
            name="sglang::scheduler",
        )
        self.proc.start()  # from the main thread: PDEATHSIG follows the creating thread
        to_r.close()
        from_w.close()
        self.to_sched, self.from_sched = to_w, from_r

    def _wait_scheduler_ready(self) -> None:
        deadline = time.monotonic() + self.args.startup_delay + SCHEDULER_LOAD_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.exitcode is not None:
                _log(f"scheduler died during start-up (exit code {self.proc.exitcode})")
                self._exit(1)
            try:
                if self.from_sched.poll(0.1):
                    msg = self.from_sched.recv()
                    if msg.get("type") == "ready":
                        self.scheduler_info = dict(msg.get("info") or {})
                        return
            except (EOFError, OSError):
                time.sleep(0.1)  # the exit code shows up on the next turn
        _log("scheduler did not load the model in time")
        self._kill_scheduler()
        self._exit(1)

    def _bind_http(self) -> None:
        try:
            self.httpd = EmulatorHTTPServer((self.args.host, self.port), EmulatorHandler)
        except OSError as exc:
            _log(f"ERROR: cannot bind {self.args.host}:{self.port}: {exc}")
            self._kill_scheduler()
            self._exit(1)
        self.httpd.emu = self
        self.port = int(self.httpd.server_address[1])
        self.serving = True
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
            name="http",
        ).start()

    def _warm_up(self) -> None:
        """Like SGLang's warm-up request: the server is 'Starting' until it completes."""
        state = ReqState(
            rid=f"warmup_{uuid.uuid4().hex}",
            input_ids=encode("The capital city of France is"),
            sampling={"max_new_tokens": 8, "temperature": 0.0},
        )
        self.register([state])
        self.pass_pause_gate_and_submit([state])
        if not state.done.wait(WARMUP_TIMEOUT_S):
            self._die_with_tree("warm-up request did not finish in time")
        with self.lock:
            if self.status == STARTING:
                self.status = UP
        spid = self.proc.pid
        print(
            f"emulator ready on http://{self.args.host}:{self.port} pid={os.getpid()} "
            f"scheduler_pid={spid}",
            flush=True,
        )
        args = self.args
        if args.orphan:
            self.spawn_orphan()
        if args.stall_generation:
            self.shared[SLOT_STALL] = 1.0
        if args.hang_http:
            self.hang_http = True
        now = time.monotonic()
        with self.lock:
            for delay, name in (
                (args.crash_after, "crash"),
                (args.crash_scheduler_after, "crash_scheduler"),
                (args.hang_http_after, "hang_http"),
                (args.stall_generation_after, "stall_generation"),
            ):
                if delay is not None:
                    self.timers.append((now + delay, name, {}))
        self.wake.set()

    def _main_loop(self) -> None:
        """Supervision: fault timers, child polling (exit mode), SIGTERM drain, orphan reaping."""
        next_poll = time.monotonic() + CHILD_POLL_INTERVAL_S
        while True:
            self.wake.wait(0.05)
            self.wake.clear()
            now = time.monotonic()
            with self.lock:
                due = [t for t in self.timers if t[0] <= now]
                self.timers = [t for t in self.timers if t[0] > now]
            for _, name, params in due:
                try:
                    _, post = self.apply_fault(name, params)
                except BadRequest as exc:
                    _log(f"timer fault failed: {exc.message}")
                    continue
                if post is not None:
                    post()
            if now >= next_poll:
                next_poll = now + CHILD_POLL_INTERVAL_S
                self._poll_children()
            if self.gracefully_exit and self.hang_http:
                # SGLang drains from its (here hung) event loop: SIGTERM cannot complete.
                if not self.hang_logged:
                    self.hang_logged = True
                    _log("SIGTERM received while the HTTP loop is hung: cannot drain")
            elif self.gracefully_exit:
                with self.lock:
                    remaining = len(self.rid_to_state)
                    unhealthy = self.status == UNHEALTHY
                if remaining == 0 or unhealthy or self.force_shutdown:
                    if remaining:
                        _log(f"SIGTERM while unhealthy: exiting with {remaining} requests left")
                    else:
                        self._wait_responses_written(5.0)
                    self.stopping = True
                    self._kill_scheduler()
                    self._exit(0)

    def _wait_responses_written(self, timeout: float) -> None:
        """Let finished /generate handlers write their answers before the process exits."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.responding > 0 and time.monotonic() < deadline:
                self.cond.wait(0.05)

    def _poll_children(self) -> None:
        for orphan in self.orphans:
            orphan.poll()  # reap, so a killed orphan does not linger as a zombie
        if self.stopping or self.proc.exitcode is None:
            return
        if self.args.dead_scheduler == "exit":
            self._die_with_tree(
                f"scheduler exited (exit code {self.proc.exitcode}); tearing the server down"
            )
        elif not self.zombie_logged:
            self.zombie_logged = True
            _log(f"scheduler exited (exit code {self.proc.exitcode}); HTTP keeps serving")

    # ---- exits and signals ----------------------------------------------------------------

    @staticmethod
    def _exit(code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def _kill_scheduler(self) -> None:
        proc = self.proc
        if proc is None or proc.exitcode is not None:
            return
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except OSError:
            return
        proc.join(2.0)

    def _die_with_tree(self, reason: str) -> None:
        """SGLang's kill_process_tree(own pid): kill the children, then SIGKILL ourselves.

        Orphans (own session) are left alone on purpose: leaking them is their point.
        """
        _log(reason)
        self.stopping = True
        self._kill_scheduler()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # not reached

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.ignore_sigterm:
            _log("SIGTERM ignored (fault)")
            return
        if not self.serving:
            # Before the port is bound SGLang has no handler yet: the default action applies.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self.gracefully_exit:
            _log("SIGTERM received: draining requests, then exiting")
        self.gracefully_exit = True
        self.wake.set()

    def _on_sigquit(self, signum: int, frame: Any) -> None:
        self._die_with_tree("SIGQUIT received: a child failed")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        _log("SIGINT received: exiting")
        self.stopping = True
        self._kill_scheduler()
        self._exit(130)

    # ---- scheduler communication ----------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        """Queue a message for the scheduler; never blocks (a stalled scheduler reads nothing)."""
        self.send_queue.put(msg)

    def _send_loop(self) -> None:
        while True:
            msg = self.send_queue.get()
            # A dead scheduler loses the message, like a dead ZMQ peer.
            with contextlib.suppress(OSError, ValueError):
                self.to_sched.send(msg)

    def _dispatch_loop(self) -> None:
        while True:
            try:
                msg = self.from_sched.recv()
            except (EOFError, OSError):
                return  # scheduler gone; _poll_children decides what that means
            try:
                with self.cond:
                    self.last_receive_ts = time.monotonic()
                    self._handle_scheduler_msg(msg)
                    self.cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - keep dispatching whatever happens
                _log(f"dispatcher error: {exc!r}")

    def _handle_scheduler_msg(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "out":
            now = time.monotonic()
            for rid, new_ids, reason in msg.get("items", ()):
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue  # e.g. a health probe that already answered
                state.output_ids.extend(new_ids)
                if not state.is_health:
                    self.generation_tokens_total += len(new_ids)
                if reason is not None:
                    state.finish_reason = reason
                    state.e2e_latency = now - state.created
                    del self.rid_to_state[rid]
                    if not state.is_health:
                        if state.submitted:
                            self.inflight -= 1
                        self.num_requests_total += 1
                        self.prompt_tokens_total += len(state.input_ids)
                    state.done.set()
                state.updated.set()
        elif kind == "reply":
            entry = self.ctl.get(int(msg.get("id", -1)))
            if entry is not None:
                entry[1] = msg.get("result")
                entry[0].set()

    def control(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """A control call to the scheduler. No timeout, like SGLang's communicators: on a
        stuck or dead scheduler it waits forever (deliberately)."""
        cid = next(self.ctl_ids)
        event = threading.Event()
        with self.lock:
            self.ctl[cid] = [event, None]
        self.send({"type": "control", "id": cid, "op": op, "args": args or {}})
        event.wait()
        with self.lock:
            entry = self.ctl.pop(cid)
        return dict(entry[1] or {})

    # ---- requests -------------------------------------------------------------------------

    def register(self, states: list[ReqState]) -> None:
        """Add requests to rid_to_state (they count for the SIGTERM drain from now on)."""
        with self.lock:
            for s in states:
                if s.rid in self.rid_to_state:
                    raise BadRequest(f"Duplicate request ID: {s.rid}")
            if len({s.rid for s in states}) != len(states):
                raise BadRequest("Duplicate request IDs in the batch")
            for s in states:
                self.rid_to_state[s.rid] = s

    def pass_pause_gate_and_submit(self, states: list[ReqState]) -> None:
        """Block while paused (forever if never continued, as in SGLang), then submit."""
        with self.cond:
            while self.is_pause:
                self.cond.wait()
            for s in states:
                self._submit_locked(s)

    def _submit_locked(self, state: ReqState) -> None:
        state.submitted = True
        if not state.is_health:
            self.inflight += 1
        self.send(
            {
                "type": "generate",
                "rid": state.rid,
                "input_ids": state.input_ids,
                "sampling": state.sampling,
                "is_health": state.is_health,
            }
        )

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        """SGLang's TokenizerManager.abort_request."""
        if not abort_all and not rid:
            return
        with self.lock:
            if not abort_all and rid not in self.rid_to_state:
                return
        self.send({"type": "abort", "rid": rid, "abort_all": abort_all})

    def pause(self, mode: str) -> None:
        """pause_generation: abort = abort in-flight requests and wait until drained (no
        timeout, as in SGLang); retract / in_place = the scheduler stops stepping."""
        with self.cond:
            self.is_pause = True
            self.cond.notify_all()
        if mode != "abort":
            self.send({"type": "pause", "mode": mode})
            return
        while True:
            self.abort(abort_all=True)
            with self.cond:
                end = time.monotonic() + 0.2
                while self.inflight > 0 and time.monotonic() < end:
                    self.cond.wait(0.05)
                if self.inflight == 0:
                    return

    def resume_generation(self) -> None:
        with self.cond:
            self.is_pause = False
            self.cond.notify_all()
        self.send({"type": "continue"})

    def health_check(self) -> bool:
        """The /health_generate probe: any scheduler output after the probe started is a pass."""
        tic = time.monotonic()
        deadline = tic + self.health_timeout
        state = ReqState(
            rid=f"{HEALTH_CHECK_RID_PREFIX}_{time.time()}_{uuid.uuid4().hex[:8]}",
            input_ids=[0],
            sampling={"max_new_tokens": 1, "temperature": 0.0},
            is_health=True,
        )
        with self.cond:
            self.rid_to_state[state.rid] = state
            try:
                while True:
                    if self.last_receive_ts > tic:
                        self.status = UP
                        return True
                    if not state.submitted and not self.is_pause:
                        self._submit_locked(state)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self.cond.wait(min(remaining, 0.25))
            finally:
                self.rid_to_state.pop(state.rid, None)
            self.status = UNHEALTHY
            return False

    def parse_generate(self, obj: dict[str, Any]) -> tuple[list[ReqState], bool]:
        """Validate a /generate body into request states; returns (states, is_batch)."""
        text, input_ids = obj.get("text"), obj.get("input_ids")
        if text is None and input_ids is None:
            raise BadRequest("Either text, input_ids or input_embeds should be provided.")
        if text is not None and input_ids is not None:
            raise BadRequest("Either text or input_ids should be provided, not both.")
        prompts: list[list[int]]
        if text is not None:
            if isinstance(text, str):
                prompts, is_batch = [encode(text)], False
            elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
                prompts, is_batch = [encode(t) for t in text], True
            else:
                raise BadRequest("text must be a string or a non-empty list of strings", True)
        elif _is_id_list(input_ids):
            prompts, is_batch = [list(input_ids)], False
        elif isinstance(input_ids, list) and input_ids and all(_is_id_list(x) for x in input_ids):
            prompts, is_batch = [list(x) for x in input_ids], True
        else:
            raise BadRequest("input_ids must be a list of ints or a list of lists of ints", True)
        for ids in prompts:
            for tok in ids:
                if not 0 <= tok < VOCAB_SIZE:
                    raise BadRequest(f"Token id {tok} is out of the vocabulary [0, {VOCAB_SIZE}).")
        raw_sampling = obj.get("sampling_params")
        if isinstance(raw_sampling, list):
            if len(raw_sampling) != len(prompts):
                raise BadRequest("sampling_params list length does not match the batch size")
            samplings = [_parse_sampling(s) for s in raw_sampling]
        else:
            samplings = [_parse_sampling(raw_sampling)] * len(prompts)
        rid = obj.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in prompts]
        elif not is_batch and isinstance(rid, str):
            rids = [rid]
        elif is_batch and isinstance(rid, list) and len(rid) == len(prompts) and all(
            isinstance(r, str) for r in rid
        ):
            rids = list(rid)
        else:
            raise BadRequest("rid must be a string (a list of strings for a batch)", True)
        states = []
        for ids, sampling, r in zip(prompts, samplings, rids, strict=True):
            total = len(ids) + sampling["max_new_tokens"]
            if total > CONTEXT_LENGTH:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of "
                    f"{CONTEXT_LENGTH} tokens. You requested a total of {total} tokens: "
                    f"{len(ids)} tokens from the input messages and "
                    f"{sampling['max_new_tokens']} tokens for the completion."
                )
            states.append(ReqState(rid=r, input_ids=ids, sampling=sampling))
        return states, is_batch

    def build_output(self, state: ReqState, finished: bool = True) -> dict[str, Any]:
        """The /generate answer for one request."""
        with self.lock:
            output_ids = list(state.output_ids)
            reason = state.finish_reason if finished else None
            latency = state.e2e_latency if finished else time.monotonic() - state.created
            version = self.weight_version
        text = decode(output_ids)
        if reason and reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            cut = text.find(reason["matched"])
            if cut >= 0:
                text = text[:cut]
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": {
                "id": state.rid,
                "finish_reason": reason,
                "prompt_tokens": len(state.input_ids),
                "weight_version": version,
                "completion_tokens": len(output_ids),
                "cached_tokens": 0,
                "e2e_latency": latency,
            },
        }

    # ---- faults ---------------------------------------------------------------------------

    def spawn_orphan(self) -> int:
        """A long-lived child in its own session, without PDEATHSIG: it outlives the engine."""
        proc = subprocess.Popen(
            [sys.executable, "-c", ORPHAN_CODE, ORPHAN_MARKER],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        with self.lock:
            self.orphans.append(proc)
        _log(f"orphan spawned: pid {proc.pid}")
        return proc.pid

    def apply_fault(
        self, name: Any, params: dict[str, Any]
    ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Apply a fault; returns (extra answer fields, action to run after answering)."""
        if name not in FAULTS:
            raise BadRequest(f"unknown fault {name!r}; known: {', '.join(FAULTS)}")
        after = params.get("after_s")
        if after is not None and name in ("crash", "crash_scheduler", "hang_http",
                                          "stall_generation"):
            if not isinstance(after, (int, float)) or after < 0:
                raise BadRequest("after_s must be a number >= 0")
            with self.lock:
                self.timers.append((time.monotonic() + float(after), name, {}))
            self.wake.set()
            return {"after_s": float(after)}, None
        if name == "crash":
            return {}, lambda: os.kill(os.getpid(), signal.SIGKILL)
        if name == "crash_scheduler":
            pid = self.proc.pid
            if self.proc.exitcode is None:
                os.kill(pid, signal.SIGKILL)
            return {"scheduler_pid": pid}, None
        if name == "hang_http":
            # At once, not after answering: a request sent right after this answer must hang.
            # (This request already passed the check, so it is still answered.)
            self.hang_http = True
            return {}, None
        if name == "stall_generation":
            self.shared[SLOT_STALL] = 1.0
            return {}, None
        if name == "unstall":
            self.shared[SLOT_STALL] = 0.0
            return {}, None
        if name in ("ignore_sigterm", "honor_sigterm"):
            self.ignore_sigterm = name == "ignore_sigterm"
            self.shared[SLOT_IGNORE_SIGTERM] = 1.0 if self.ignore_sigterm else 0.0
            return {}, None
        if name == "orphan":
            return {"orphan_pid": self.spawn_orphan()}, None
        if name == "exit":
            code = params.get("code", 1)
            if not isinstance(code, int) or isinstance(code, bool):
                raise BadRequest("code must be an integer")
            return {"code": code}, lambda: self._exit(code & 0xFF)
        # token_latency
        ms = params.get("ms")
        if not isinstance(ms, (int, float)) or isinstance(ms, bool) or ms < 0:
            raise BadRequest("ms must be a number >= 0")
        self.shared[SLOT_TOKEN_LATENCY_MS] = float(ms)
        return {"ms": float(ms)}, None

    def info(self) -> dict[str, Any]:
        """GET /_emulator/info."""
        with self.lock:
            orphans = [p.pid for p in self.orphans if p.returncode is None]
            return {
                "pid": os.getpid(),
                "scheduler_pid": self.proc.pid,
                "scheduler_alive": self.proc.exitcode is None,
                "orphan_pids": orphans,
                "faults": {
                    "hang_http": self.hang_http,
                    "stall_generation": self.shared[SLOT_STALL] >= 0.5,
                    "ignore_sigterm": self.ignore_sigterm,
                    "dead_scheduler": self.args.dead_scheduler,
                    "pending": sorted(t[1] for t in self.timers),
                },
                "token_latency_ms": self.shared[SLOT_TOKEN_LATENCY_MS],
                "status": self.status,
                "paused": self.is_pause,
                "draining": self.gracefully_exit,
                "memory_released": sorted(self.memory_released),
                "num_inflight": self.inflight,
                "num_pending": len(self.rid_to_state),
                "weight_version": self.weight_version,
                "health_check_timeout": self.health_timeout,
                "torch_imported": "torch" in sys.modules,
                "version": EMULATED_SGLANG_VERSION,
            }

    def server_args(self) -> dict[str, Any]:
        """Server args as /server_info reports them (SGLang names where they exist)."""
        a = self.args
        return {
            "model_path": a.model_path,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "served_model_name": self.served_model_name,
            "host": a.host,
            "port": self.port,
            "nccl_port": a.nccl_port,
            "weight_version": self.weight_version,
            "enable_metrics": bool(a.enable_metrics),
            "enable_memory_saver": bool(a.enable_memory_saver),
            "context_length": CONTEXT_LENGTH,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "nnodes": 1,
            "node_rank": 0,
            "random_seed": 0,
            "watchdog_timeout": 300,
            "skip_server_warmup": False,
            "emulator": {
                "dead_scheduler": a.dead_scheduler,
                "token_latency_ms": self.shared[SLOT_TOKEN_LATENCY_MS],
                "health_check_timeout": self.health_timeout,
            },
        }

    def metrics_text(self) -> str:
        """Prometheus text like SGLang's /metrics (scheduler gauges, tokenizer counters)."""
        name = self.served_model_name.replace("\\", "\\\\").replace('"', '\\"')
        glabels = f'{{model_name="{name}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
        clabels = f'{{model_name="{name}"}}'
        with self.lock:
            counters = (
                ("generation_tokens", "Number of generation tokens processed.",
                 self.generation_tokens_total),
                ("prompt_tokens", "Number of prefill tokens processed.", self.prompt_tokens_total),
                ("num_requests", "Number of requests processed.", self.num_requests_total),
            )
        gauges = (
            ("num_running_reqs", "The number of running requests.", SLOT_NUM_RUNNING),
            ("num_queue_reqs", "The number of requests in the waiting queue.", SLOT_NUM_QUEUE),
            ("gen_throughput", "The generation throughput (token/s).", SLOT_GEN_THROUGHPUT),
        )
        lines = []
        for metric, help_text, slot in gauges:
            lines += [
                f"# HELP sglang:{metric} {help_text}",
                f"# TYPE sglang:{metric} gauge",
                f"sglang:{metric}{glabels} {float(self.shared[slot])}",
            ]
        for metric, help_text, value in counters:
            lines += [
                f"# HELP sglang:{metric}_total {help_text}",
                f"# TYPE sglang:{metric}_total counter",
                f"sglang:{metric}_total{clabels} {float(value)}",
            ]
        return "\n".join(lines) + "\n"


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in value
    )


def _parse_sampling(raw: Any) -> dict[str, Any]:
    """Validate sampling_params (unknown keys are ignored)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest("sampling_params must be an object", True)
    max_new = raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None:
        max_new = DEFAULT_MAX_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise BadRequest(f"max_new_tokens must be a non-negative integer, got {max_new!r}")
    temperature = raw.get("temperature", 0.0)
    if temperature is None:
        temperature = 0.0
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or (
        temperature < 0
    ):
        raise BadRequest(f"temperature must be a non-negative number, got {temperature!r}")
    stop = raw.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of strings", True)
    stop_ids = raw.get("stop_token_ids") or []
    if not _is_id_list(stop_ids):
        raise BadRequest("stop_token_ids must be a list of ints", True)
    return {
        "max_new_tokens": max_new,
        "temperature": float(temperature),
        "stop": stop,
        "stop_token_ids": stop_ids,
        "ignore_eos": bool(raw.get("ignore_eos", False)),
    }


# ---- HTTP ---------------------------------------------------------------------------------

ROUTES: dict[str, tuple[frozenset[str], str]] = {
    "/health": (frozenset({"GET"}), "health"),
    "/health_generate": (frozenset({"GET"}), "health"),
    "/ready": (frozenset({"GET"}), "ready"),
    "/model_info": (frozenset({"GET"}), "model_info"),
    "/get_model_info": (frozenset({"GET"}), "model_info"),
    "/get_weight_version": (frozenset({"GET"}), "weight_version"),
    "/server_info": (frozenset({"GET"}), "server_info"),
    "/get_server_info": (frozenset({"GET"}), "server_info"),
    "/generate": (frozenset({"POST", "PUT"}), "generate"),
    "/pause_generation": (frozenset({"POST"}), "pause"),
    "/continue_generation": (frozenset({"POST"}), "continue"),
    "/release_memory_occupation": (frozenset({"GET", "POST"}), "release"),
    "/resume_memory_occupation": (frozenset({"GET", "POST"}), "resume"),
    "/flush_cache": (frozenset({"GET", "POST"}), "flush_cache"),
    "/abort_request": (frozenset({"POST"}), "abort_request"),
    "/update_weight_version": (frozenset({"POST"}), "update_weight_version"),
    "/metrics": (frozenset({"GET"}), "metrics"),
    "/v1/models": (frozenset({"GET"}), "models"),
    "/_emulator/info": (frozenset({"GET"}), "emu_info"),
    "/_emulator/fault": (frozenset({"POST"}), "emu_fault"),
}


class EmulatorHTTPServer(ThreadingHTTPServer):
    """Threaded HTTP server; quiet about client disconnects, no reverse DNS at bind."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128
    emu: EmulatorServer

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can stall start-up.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        _log(f"HTTP error with {client_address}: {exc!r}")


class EmulatorHandler(BaseHTTPRequestHandler):
    """Routes requests to the engine; JSON bodies and status codes as SGLang's FastAPI app."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    timeout = 600  # bounds body reads and idle keep-alive connections
    server: EmulatorHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    # ---- plumbing -------------------------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """JSON instead of the base class's HTML error page (malformed requests)."""
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        self.close_connection = True
        self._send(code, json.dumps({"detail": message or phrase}).encode(),
                   headers={"Connection": "close"})

    def _send(
        self,
        code: int,
        body: bytes,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(code)
        if body or content_type != "application/json":
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
        self._responded = True

    def _json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(obj).encode(), headers=headers)

    def _empty(self, code: int) -> None:
        self._send(code, b"")

    def _bad_request(self, exc: BadRequest) -> None:
        if exc.validation:
            phrase = HTTPStatus(exc.code).phrase
            self._json(exc.code, {"object": "error", "message": exc.message, "type": phrase,
                                  "param": None, "code": exc.code})
        else:
            self._json(exc.code, {"error": {"message": exc.message}})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks, total = [], 0
            while True:
                line = self.rfile.readline(1024)
                try:
                    size = int(line.split(b";")[0].strip() or b"x", 16)
                except ValueError:
                    raise BadRequest("malformed chunked body", True) from None
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY_BYTES:
                    raise BadRequest("request body too large", True, code=413)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            n = int(length)
        except ValueError:
            raise BadRequest("invalid Content-Length", True) from None
        if n < 0 or n > MAX_BODY_BYTES:
            raise BadRequest("request body too large", True, code=413)
        return self.rfile.read(n) if n else b""

    @staticmethod
    def _json_body(body: bytes) -> dict[str, Any]:
        """Parse the body like FastAPI for a model argument: an empty body is a 400."""
        if not body.strip():
            raise BadRequest(
                "[{'type': 'missing', 'loc': ('body',), 'msg': 'Field required', "
                "'input': None}]",
                validation=True,
            )
        try:
            obj = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(
                f"[{{'type': 'json_invalid', 'loc': ('body',), 'msg': 'JSON decode error', "
                f"'ctx': {{'error': {str(exc)!r}}}}}]",
                validation=True,
            ) from None
        if not isinstance(obj, dict):
            raise BadRequest(
                "[{'type': 'model_attributes_type', 'loc': ('body',), 'msg': 'Input should be "
                "a valid dictionary or object to extract fields from'}]",
                validation=True,
            )
        return obj

    def _client_gone(self) -> bool:
        """True when the client closed its connection (EOF readable), like Starlette's
        request.is_disconnected()."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _dispatch(self, method: str) -> None:
        emu = self.server.emu
        if emu.hang_http:
            _FOREVER.wait()  # deliberately forever: a hung HTTP loop
        self._responded = False
        url = urlsplit(self.path)
        self.url_path = url.path
        self.query = parse_qs(url.query)
        try:
            body = self._read_body()
        except BadRequest as exc:
            self.close_connection = True
            self._bad_request(exc)
            return
        route = ROUTES.get(url.path)
        if route is None or (url.path == "/metrics" and not emu.args.enable_metrics):
            self._json(404, {"detail": "Not Found"})
            return
        methods, name = route
        if method not in methods:
            self._json(405, {"detail": "Method Not Allowed"},
                       headers={"Allow": ", ".join(sorted(methods))})
            return
        try:
            getattr(self, "h_" + name)(emu, body)
        except BadRequest as exc:
            if not self._responded:
                self._bad_request(exc)
        except (ClientGone, ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - never a traceback, always an answer
            _log(f"internal error on {method} {url.path}: {exc!r}")
            self.close_connection = True
            if not self._responded:
                self._json(500, {"error": {"message": f"Internal server error: {exc}"}})

    # ---- handlers -------------------------------------------------------------------------

    def h_health(self, emu: EmulatorServer, body: bytes) -> None:
        if emu.gracefully_exit or emu.status == STARTING:
            self._empty(503)
            return
        if self.url_path == "/health" and not emu.health_generation:
            self._empty(200)
            return
        self._empty(200 if emu.health_check() else 503)

    def h_ready(self, emu: EmulatorServer, body: bytes) -> None:
        ok = emu.status == UP and not emu.is_pause and not emu.gracefully_exit
        self._empty(200 if ok else 503)

    def h_model_info(self, emu: EmulatorServer, body: bytes) -> None:
        a = emu.args
        self._json(200, {
            "model_path": a.model_path,
            "tokenizer_path": a.tokenizer_path or a.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": emu.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "emulator",
            "architectures": ["TinyLM"],
        })

    def h_weight_version(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, {"weight_version": emu.weight_version})

    def h_server_info(self, emu: EmulatorServer, body: bytes) -> None:
        sched = emu.control("server_info")  # no timeout: never use /server_info as a probe
        internal = sched.pop("internal_states", [])
        self._json(200, {
            **emu.server_args(),
            **emu.scheduler_info,
            **sched,
            "internal_states": internal,
            "version": EMULATED_SGLANG_VERSION,
        })

    def h_generate(self, emu: EmulatorServer, body: bytes) -> None:
        obj = self._json_body(body)
        states, is_batch = emu.parse_generate(obj)
        stream = bool(obj.get("stream", False))
        if stream and is_batch:
            raise BadRequest("streaming batch requests are not supported by the emulator")
        emu.register(states)
        with emu.lock:
            emu.responding += 1
        try:
            self._generate_registered(emu, states, is_batch, stream)
        finally:
            with emu.cond:
                emu.responding -= 1
                emu.cond.notify_all()

    def _generate_registered(
        self, emu: EmulatorServer, states: list[ReqState], is_batch: bool, stream: bool
    ) -> None:
        emu.pass_pause_gate_and_submit(states)
        try:
            if stream:
                self._stream(emu, states[0])
                return
            for state in states:
                while not state.done.wait(0.25):
                    if self._client_gone():
                        raise ClientGone()
        except (ClientGone, ConnectionError, TimeoutError):
            for state in states:
                if not state.done.is_set():
                    emu.abort(state.rid)
            raise
        outs = [emu.build_output(s) for s in states]
        self._json(200, outs if is_batch else outs[0])

    def _stream(self, emu: EmulatorServer, state: ReqState) -> None:
        """Server-sent events, one cumulative chunk per decode step, then [DONE]."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._responded = True
        sent = -1
        while True:
            state.updated.wait(0.25)
            state.updated.clear()
            finished = state.done.is_set()
            with emu.lock:
                n = len(state.output_ids)
            if n != sent or finished:
                sent = n
                chunk = emu.build_output(state, finished=finished)
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if finished:
                break
            if self._client_gone():
                raise ClientGone()
        self.wfile.write(b"data: [DONE]\n\n")

    def h_pause(self, emu: EmulatorServer, body: bytes) -> None:
        obj = self._json_body(body)
        mode = obj.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(
                f"[{{'type': 'literal_error', 'loc': ('body', 'mode'), 'msg': \"Input should be "
                f"'abort', 'retract' or 'in_place'\", 'input': {mode!r}}}]",
                validation=True,
            )
        emu.pause(mode)
        self._json(200, {"message": "Generation paused successfully.", "status": "ok"})

    def h_continue(self, emu: EmulatorServer, body: bytes) -> None:
        self._json_body(body)
        emu.resume_generation()
        self._json(200, {"message": "Generation continued successfully.", "status": "ok"})

    def _memory_tags(self, emu: EmulatorServer, body: bytes, what: str) -> list[str] | None:
        obj = self._json_body(body)
        if not emu.args.enable_memory_saver:
            raise BadRequest(
                f"{what} requires the server to be started with --enable-memory-saver"
            )
        tags = obj.get("tags")
        if tags is not None and (
            not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags)
        ):
            raise BadRequest(f"tags must be null or a list of {list(MEMORY_TAGS)}", True)
        return tags

    def h_release(self, emu: EmulatorServer, body: bytes) -> None:
        tags = self._memory_tags(emu, body, "release_memory_occupation")
        emu.control("release", {"tags": tags})  # a busy scheduler dies here (server exits)
        with emu.lock:
            emu.memory_released.update(tags or MEMORY_TAGS)
        self._json(200, None)

    def h_resume(self, emu: EmulatorServer, body: bytes) -> None:
        tags = self._memory_tags(emu, body, "resume_memory_occupation")
        emu.control("resume", {"tags": tags})
        with emu.lock:
            emu.memory_released.difference_update(tags or MEMORY_TAGS)
        self._json(200, None)

    def h_flush_cache(self, emu: EmulatorServer, body: bytes) -> None:
        timeout = 0.0
        if "timeout" in self.query:
            try:
                timeout = max(0.0, float(self.query["timeout"][0]))
            except ValueError:
                raise BadRequest("timeout must be a number", True) from None
        deadline = time.monotonic() + timeout
        while True:
            ok = bool(emu.control("flush_cache").get("success"))
            if ok or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self._send(200 if ok else 400, FLUSH_CACHE_TEXT.encode(), "text/plain; charset=utf-8")

    def h_abort_request(self, emu: EmulatorServer, body: bytes) -> None:
        obj = self._json_body(body)
        rid = obj.get("rid", "")
        if rid is None:
            rid = ""
        if not isinstance(rid, str):
            raise BadRequest("rid must be a string", True)
        emu.abort(rid, bool(obj.get("abort_all", False)))
        self._empty(200)

    def h_update_weight_version(self, emu: EmulatorServer, body: bytes) -> None:
        obj = self._json_body(body)
        version = obj.get("new_version")
        if not isinstance(version, str):
            raise BadRequest("new_version is required and must be a string", True)
        if obj.get("abort_all_requests", False):
            emu.abort(abort_all=True)
        with emu.lock:
            emu.weight_version = version
        self._json(200, {"success": True, "message": f"Weight version updated to {version}",
                         "new_version": version})

    def h_metrics(self, emu: EmulatorServer, body: bytes) -> None:
        self._send(200, emu.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def h_models(self, emu: EmulatorServer, body: bytes) -> None:
        name = emu.served_model_name
        self._json(200, {"object": "list", "data": [{
            "id": name, "object": "model", "created": 0, "owned_by": "sglang", "root": name,
            "max_model_len": CONTEXT_LENGTH,
        }]})

    def h_emu_info(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, emu.info())

    def h_emu_fault(self, emu: EmulatorServer, body: bytes) -> None:
        obj = self._json_body(body)
        name = obj.get("fault")
        extra, post = emu.apply_fault(name, obj)
        self._json(200, {"ok": True, "fault": name, **extra})
        if post is not None:
            post()
