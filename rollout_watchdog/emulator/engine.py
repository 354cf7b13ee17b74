"""The tokenizer-manager half of the emulator's main process: requests, pause, health, and the
link to the scheduler child (two pipes and a shared array of flags and gauges).

Requests go to the scheduler through a sender thread (a stalled scheduler reads nothing, so a
send must never block a handler); a dispatcher thread resolves them as token outputs come back.
Waits that SGLang makes endless (paused requests, control calls) are endless here too.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import multiprocessing
import os
import queue
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from rollout_watchdog.emulator import protocol
from rollout_watchdog.emulator.common import (
    HEALTH_CHECK_RID_PREFIX,
    SHARED_SLOTS,
    SLOT_GEN_THROUGHPUT,
    SLOT_NUM_QUEUE,
    SLOT_NUM_RUNNING,
    SLOT_TOKEN_LATENCY_MS,
    WEIGHT_SESSION_SINCE,
    log,
    version_tuple,
)
from rollout_watchdog.emulator.protocol import STARTING, UNHEALTHY, UP, BadRequest, ReqState


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def env_bool(name: str, default: str) -> bool:
    """Same parsing as SGLang's get_bool_env_var: only "true"/"1" are true."""
    return os.environ.get(name, default).strip().lower() in ("true", "1")


class Engine:
    """SGLang's TokenizerManager as far as the HTTP surface can tell."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.health_timeout = _env_float("SGLANG_HEALTH_CHECK_TIMEOUT", 20.0)
        self.health_generation = env_bool("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "true")
        self.served_model_name: str = args.served_model_name or args.model_path
        self.weight_version: str = args.weight_version
        # SGLang 0.5.21+: weight updates bracketed by begin/end_weight_update
        self.weight_session = version_tuple(args.sglang_version) >= WEIGHT_SESSION_SINCE
        self.writers_waiting = 0  # model-update lock (writer side); readers are `inflight`
        self.writer_active = False
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.rid_to_state: dict[str, ReqState] = {}
        self.inflight = 0  # submitted, unfinished, non-health requests (SGLang's reader lock)
        self.responding = 0  # /generate handlers that have not finished writing their answer
        self.is_pause = False
        self.status = STARTING
        self.gracefully_exit = False
        self.last_receive_ts = 0.0
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.num_requests_total = 0
        self.memory_released: set[str] = set()
        self.ctx = multiprocessing.get_context("spawn")
        self.shared: Any = self.ctx.RawArray("d", SHARED_SLOTS)
        self.shared[SLOT_TOKEN_LATENCY_MS] = float(args.token_latency_ms)
        self.send_queue: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self.ctl_ids = itertools.count(1)
        self.ctl: dict[int, list[Any]] = {}
        self.to_sched: Any = None
        self.from_sched: Any = None

    # ---- scheduler communication ----------------------------------------------------------

    def send(self, msg: dict[str, Any]) -> None:
        """Queue a message for the scheduler; never blocks (a stalled scheduler reads nothing)."""
        self.send_queue.put(msg)

    def send_loop(self) -> None:
        """The sender thread."""
        while True:
            msg = self.send_queue.get()
            # A dead scheduler loses the message, like a dead ZMQ peer.
            with contextlib.suppress(OSError, ValueError):
                self.to_sched.send(msg)

    def dispatch_loop(self) -> None:
        """The dispatcher thread: applies the scheduler's messages until its pipe closes."""
        while True:
            try:
                msg = self.from_sched.recv()
            except (EOFError, OSError):
                return  # scheduler gone; the server's child polling decides what that means
            try:
                with self.cond:
                    self.last_receive_ts = time.monotonic()
                    self._handle_scheduler_msg(msg)
                    self.cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - keep dispatching whatever happens
                log(f"dispatcher error: {exc!r}")

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
            while self.is_pause or self.writer_active or self.writers_waiting:
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
        """continue_generation (waits for a weight update in progress, as in SGLang)."""
        with self.cond:
            while self.writer_active:
                self.cond.wait()
            self.is_pause = False
            self.cond.notify_all()
        self.send({"type": "continue"})

    @contextlib.contextmanager
    def model_update(self) -> Iterator[None]:
        """SGLang's model-update lock around a weight update (no timeout).

        Unpaused, it is the writer side: wait until no request is in flight, and hold new ones
        at the gate until done (writers first). Paused, whoever paused holds it: run at once.
        Either way continue_generation waits until the update is done.
        """
        with self.cond:
            paused = self.is_pause
            self.writers_waiting += 1
            try:
                while self.writer_active or (not paused and self.inflight > 0):
                    self.cond.wait()
            finally:
                self.writers_waiting -= 1
            self.writer_active = True
        try:
            yield
        finally:
            with self.cond:
                self.writer_active = False
                self.cond.notify_all()

    def set_weight_version(self, version: str, abort_all: bool) -> None:
        """update_weight_version, optionally aborting every request first."""
        if abort_all:
            self.abort(abort_all=True)
        with self.lock:
            self.weight_version = version

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

    def wait_responses_written(self, timeout: float) -> None:
        """Let finished /generate handlers write their answers before the process exits."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while self.responding > 0 and time.monotonic() < deadline:
                self.cond.wait(0.05)

    # ---- answers --------------------------------------------------------------------------

    def output(self, state: ReqState, finished: bool = True) -> dict[str, Any]:
        """The /generate answer for one request (a cumulative chunk while streaming)."""
        with self.lock:
            output_ids = list(state.output_ids)
            reason = state.finish_reason if finished else None
            latency = state.e2e_latency if finished else time.monotonic() - state.created
            version = self.weight_version
        return protocol.generate_output(
            state.rid, len(state.input_ids), output_ids, reason, latency, version
        )

    def metrics_text(self) -> str:
        """GET /metrics: scheduler gauges (shared array), tokenizer counters."""
        with self.lock:
            counters = (
                self.generation_tokens_total, self.prompt_tokens_total, self.num_requests_total,
            )
        gauges = (
            float(self.shared[SLOT_NUM_RUNNING]),
            float(self.shared[SLOT_NUM_QUEUE]),
            float(self.shared[SLOT_GEN_THROUGHPUT]),
        )
        return protocol.metrics_text(self.served_model_name, gauges, counters)
