"""Main process of the emulator: process start, scheduler child, supervision, signals.

The process model mirrors SGLang's: this process serves HTTP (:mod:`routes`) and spawns a
scheduler child (multiprocessing "spawn") that runs a tiny torch model. Requests go to the
scheduler over a pipe (:mod:`engine`). Torch is never imported here, so the main process stays
light.

Behaviour follows SGLang 0.5.23, or the older release given with ``--sglang-version`` where
the weight-update endpoints differ (see ``shared/SGLANG.md``): same paths, bodies, status codes and
blocking behaviour, including the deliberate "forever" waits (paused requests, control calls on a
stuck scheduler). Every other wait is bounded. Faults (:mod:`faults`) are available as start-up
flags and through the private endpoint ``POST /_emulator/fault``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, NoReturn

from rollout_watchdog.emulator import faults, protocol
from rollout_watchdog.emulator import scheduler as scheduler_mod
from rollout_watchdog.emulator.common import (
    SLOT_TOKEN_LATENCY_MS,
    encode,
    log,
)
from rollout_watchdog.emulator.engine import Engine, env_bool
from rollout_watchdog.emulator.options import build_parser
from rollout_watchdog.emulator.protocol import STARTING, UNHEALTHY, UP, BadRequest, ReqState
from rollout_watchdog.emulator.routes import EmulatorHandler, EmulatorHTTPServer

SCHEDULER_LOAD_TIMEOUT_S = 300.0  # on top of --startup-delay
WARMUP_TIMEOUT_S = 600.0
CHILD_POLL_INTERVAL_S = 1.0  # SGLang 0.5.12+ polls its children every second


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


class EmulatorServer(Engine):
    """The engine plus its process: scheduler child, HTTP server, faults, signals, exits."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.force_shutdown = env_bool("SGL_FORCE_SHUTDOWN", "false")
        self.serving = False
        self.stopping = False
        self.hang_http: bool = False  # fault state: read by every request and the SIGTERM drain
        self.ignore_sigterm: bool = False  # fault state: read by the SIGTERM handler
        self.orphans: list[subprocess.Popen[bytes]] = []
        self.timers: list[tuple[float, str]] = []  # (monotonic deadline, fault name)
        self.wake = threading.Event()
        self.proc: Any = None
        self.scheduler_info: dict[str, Any] = {}
        self.httpd: EmulatorHTTPServer | None = None
        self.port = int(args.port)
        self.zombie_logged = False
        self.hang_logged = False
        faults.apply_at_start(self)

    # ---- lifecycle ------------------------------------------------------------------------

    def serve(self) -> int:
        """Start everything, then supervise from the main thread until exit."""
        signal.signal(signal.SIGTERM, self._on_sigterm)
        signal.signal(signal.SIGQUIT, self._on_sigquit)
        signal.signal(signal.SIGINT, self._on_sigint)
        self._start_scheduler()
        self._wait_scheduler_ready()
        threading.Thread(target=self.dispatch_loop, name="dispatcher", daemon=True).start()
        threading.Thread(target=self.send_loop, name="sender", daemon=True).start()
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
            "hidden_size": int(self.args.hidden_size),
            "no_model": bool(self.args.no_model),
            "weight_spec": self.args.weight_spec,  # resolved by the parser: tiny, learn or a dict
            "sglang_version": self.args.sglang_version,
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
                log(f"scheduler died during start-up (exit code {self.proc.exitcode})")
                self.exit(1)
            try:
                if self.from_sched.poll(0.1):
                    msg = self.from_sched.recv()
                    if msg.get("type") == "ready":
                        self.scheduler_info = dict(msg.get("info") or {})
                        return
            except (EOFError, OSError):
                time.sleep(0.1)  # the exit code shows up on the next turn
        log("scheduler did not load the model in time")
        self._kill_scheduler()
        self.exit(1)

    def _bind_http(self) -> None:
        try:
            httpd = EmulatorHTTPServer((self.args.host, self.port), EmulatorHandler)
        except OSError as exc:
            log(f"ERROR: cannot bind {self.args.host}:{self.port}: {exc}")
            self._kill_scheduler()
            self.exit(1)
        self.httpd = httpd
        httpd.emu = self
        self.port = int(httpd.server_address[1])
        self.serving = True
        threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True,
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
        faults.apply_at_ready(self)

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
            for _, name in due:
                try:
                    _, post = faults.inject(self, name, {})
                except BadRequest as exc:
                    log(f"timer fault failed: {exc.message}")
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
                    log("SIGTERM received while the HTTP loop is hung: cannot drain")
            elif self.gracefully_exit:
                with self.lock:
                    remaining = len(self.rid_to_state)
                    unhealthy = self.status == UNHEALTHY
                if remaining == 0 or unhealthy or self.force_shutdown:
                    if remaining:
                        log(f"SIGTERM while unhealthy: exiting with {remaining} requests left")
                    else:
                        self.wait_responses_written(5.0)
                    self.stopping = True
                    self._kill_scheduler()
                    self.exit(0)

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
            log(f"scheduler exited (exit code {self.proc.exitcode}); HTTP keeps serving")

    # ---- exits and signals ----------------------------------------------------------------

    @staticmethod
    def exit(code: int) -> NoReturn:
        """Leave at once, like a server process that tears itself down (no cleanup)."""
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
        log(reason)
        self.stopping = True
        self._kill_scheduler()
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
        os._exit(137)  # not reached

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self.ignore_sigterm:
            log("SIGTERM ignored (fault)")
            return
        if not self.serving:
            # Before the port is bound SGLang has no handler yet: the default action applies.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if not self.gracefully_exit:
            log("SIGTERM received: draining requests, then exiting")
        self.gracefully_exit = True
        self.wake.set()

    def _on_sigquit(self, signum: int, frame: Any) -> None:
        self._die_with_tree("SIGQUIT received: a child failed")

    def _on_sigint(self, signum: int, frame: Any) -> None:
        log("SIGINT received: exiting")
        self.stopping = True
        self._kill_scheduler()
        self.exit(130)

    # ---- reports --------------------------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """GET /_emulator/info."""
        with self.lock:
            orphans = [p.pid for p in self.orphans if p.returncode is None]
            return {
                "pid": os.getpid(),
                "scheduler_pid": self.proc.pid,
                "scheduler_alive": self.proc.exitcode is None,
                "orphan_pids": orphans,
                "faults": {**faults.report(self), "dead_scheduler": self.args.dead_scheduler},
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
                "version": self.args.sglang_version,
            }

    def server_args(self) -> dict[str, Any]:
        """Server args as /server_info reports them."""
        return protocol.server_args(
            self.args,
            served_model_name=self.served_model_name,
            port=self.port,
            weight_version=self.weight_version,
            token_latency_ms=self.shared[SLOT_TOKEN_LATENCY_MS],
            health_check_timeout=self.health_timeout,
        )
