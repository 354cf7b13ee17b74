"""The emulator's scheduler child process (stands in for ``sglang::scheduler``).

Started by the main process with the multiprocessing "spawn" context. It loads the tiny torch
model (torch is imported here, never in the main process; neither with --no-model), then runs
an event loop: read requests and control messages from the main process, run one decode step
for every running request, send the new tokens back. Like SGLang's scheduler it sets
PR_SET_PDEATHSIG=SIGKILL so it dies with the main process, and on an internal error it sends
SIGQUIT to its parent, which then tears the whole server down.

Messages (plain dicts over two simplex multiprocessing pipes):

main -> scheduler:
  {"type": "generate", "rid", "input_ids", "sampling": {...}, "is_health"}
  {"type": "abort", "rid", "abort_all"}
  {"type": "pause", "mode"} / {"type": "continue"}
  {"type": "control", "id", "op", "args"}   (op: release, resume, flush_cache, server_info,
                                             and the weight-update ops of WEIGHT_OPS)
scheduler -> main:
  {"type": "ready", "pid", "info"}
  {"type": "out", "items": [(rid, new_token_ids, finish_reason_or_None), ...]}
  {"type": "reply", "id", "result"}

Control calls are answered in order. A weight update wedged by the fault hang_weight_update is
never answered, and neither is any control call after it (they queue behind it), while
generation goes on.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from rollout_watchdog.emulator.common import (
    CONTEXT_LENGTH,
    EOS_TOKEN_ID,
    FLUSH_FAILURE_ANSWERED_SINCE,
    HANG_STAGES,
    MAX_RUNNING_REQUESTS,
    SLOT_GEN_THROUGHPUT,
    SLOT_HANG_WEIGHT_UPDATE,
    SLOT_IGNORE_SIGTERM,
    SLOT_NUM_QUEUE,
    SLOT_NUM_RUNNING,
    SLOT_STALL,
    SLOT_TOKEN_LATENCY_MS,
    WEIGHT_SESSION_SINCE,
    decode,
    version_tuple,
)
from rollout_watchdog.emulator.weight_spec import LEARN, TINY

if TYPE_CHECKING:
    from rollout_watchdog.emulator.weight_sync import WeightSync

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
ALL_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
WEIGHT_OPS = (
    "init_weights_update_group",
    "destroy_weights_update_group",
    "begin_weight_update",
    "end_weight_update",
    "update_weights_from_distributed",
)
NO_MODEL_REFUSAL = (
    "this emulator was started with --no-model (a test speed knob): it has no weights to update"
)
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running "
    "or queued. Retract or finish them, then call /flush_cache."
)


def _prctl(option: int, arg: int | bytes) -> None:
    """Best-effort prctl(2): the emulator must still run where libc is not glibc."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)
    except (OSError, AttributeError):
        pass


@dataclass
class Req:
    """One request inside the scheduler (its waiting queue or running batch)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    stop_token_ids: set[int]
    stop_strs: list[str]
    is_health: bool
    output_ids: list[int] = field(default_factory=list)


class Scheduler:
    """Event loop of the scheduler child: batching, decode steps, pause, memory release."""

    def __init__(
        self, recv: Connection, send: Connection, config: dict[str, Any], shared: Any
    ) -> None:
        self.recv = recv
        self.send_conn = send
        self.config = config
        self.shared = shared
        self.waiting: deque[Req] = deque()
        self.running: dict[str, Req] = {}
        self.pause_mode: str | None = None
        self.released: set[str] = set()
        self.weights_backup: Any = None
        self.model: Any = None
        self.weight_sync: WeightSync | None = None  # made at the first weight op
        self.version = version_tuple(str(config["sglang_version"]))
        self.control_wedged = False  # a weight update hangs (fault): no control call answers
        self.sigterm_ignored: bool | None = None
        self.throughput_window: deque[tuple[float, int]] = deque()
        self.last_gen_throughput = 0.0

    # ---- start-up -------------------------------------------------------------------------

    def load(self) -> None:
        """'Load the model': the configured start-up delay, then torch and the tiny model
        (neither with --no-model: importing torch is most of an engine's start-up CPU)."""
        deadline = time.monotonic() + float(self.config.get("startup_delay", 0.0))
        while time.monotonic() < deadline:
            self._apply_flags()
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        if self.config.get("no_model"):
            return
        import warnings

        warnings.filterwarnings("ignore", message=".*NumPy.*")
        import torch

        torch.set_num_threads(1)
        from rollout_watchdog.emulator import model as model_mod

        self._model_mod = model_mod
        self.model = model_mod.build_model(
            hidden_size=int(self.config.get("hidden_size", model_mod.HIDDEN_SIZE)))

    def info(self) -> dict[str, Any]:
        """Scheduler info merged into /server_info (like SGLang's scheduler_info)."""
        return {
            "max_total_num_tokens": CONTEXT_LENGTH * MAX_RUNNING_REQUESTS,
            "max_req_input_len": CONTEXT_LENGTH - 1,
            "max_running_requests": MAX_RUNNING_REQUESTS,
        }

    # ---- event loop -----------------------------------------------------------------------

    def event_loop(self) -> None:
        """Run forever; the main process ends us (SIGKILL, PDEATHSIG or pipe EOF)."""
        while True:
            self._apply_flags()
            if self._stalled():
                # Stalled: read nothing, produce nothing (a stuck forward pass or collective).
                time.sleep(0.01)
                continue
            timeout = 0.0 if self._runnable() else 0.05
            # Re-check the stall flag once poll() returns: a message that arrives after the
            # flag was set must not be served (the fault is answered before the next request).
            if self.recv.poll(timeout) and not self._stalled():
                for _ in range(10_000):
                    self._handle(self.recv.recv())
                    if self._stalled() or not self.recv.poll(0):
                        break
            if self._runnable() and not self._stalled():
                self._step()
            self._publish_gauges()

    def _stalled(self) -> bool:
        return bool(self.shared[SLOT_STALL] >= 0.5)

    def _apply_flags(self) -> None:
        """Follow the main process's run-time fault flags that concern this process."""
        ignore = self.shared[SLOT_IGNORE_SIGTERM] >= 0.5
        if ignore != self.sigterm_ignored:
            signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else signal.SIG_DFL)
            self.sigterm_ignored = ignore

    def _runnable(self) -> bool:
        return (
            self.pause_mode is None
            and not self.released
            and bool(self.waiting or self.running)
        )

    def _publish_gauges(self) -> None:
        self.shared[SLOT_NUM_RUNNING] = float(len(self.running))
        self.shared[SLOT_NUM_QUEUE] = float(len(self.waiting))
        self.shared[SLOT_GEN_THROUGHPUT] = self.last_gen_throughput

    def _out(self, items: list[tuple[str, list[int], dict[str, Any] | None]]) -> None:
        if items:
            self.send_conn.send({"type": "out", "items": items})

    # ---- messages -------------------------------------------------------------------------

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg.get("type")
        if kind == "generate":
            self._add_request(msg)
        elif kind == "abort":
            self._abort(msg.get("rid") or "", bool(msg.get("abort_all")))
        elif kind == "pause":
            self._pause(str(msg.get("mode") or "in_place"))
        elif kind == "continue":
            self.pause_mode = None
        elif kind == "control":
            if self.control_wedged:
                return  # queued behind the wedged weight update: never answered either
            op, args = str(msg.get("op")), msg.get("args") or {}
            result = self._weight_op(op, args) if op in WEIGHT_OPS else self._control(op, args)
            if result is None:
                self.control_wedged = True
                return
            self.send_conn.send({"type": "reply", "id": msg.get("id"), "result": result})

    def _add_request(self, msg: dict[str, Any]) -> None:
        sampling = msg.get("sampling") or {}
        req = Req(
            rid=str(msg["rid"]),
            input_ids=list(msg["input_ids"]),
            max_new_tokens=int(sampling.get("max_new_tokens", 16)),
            temperature=float(sampling.get("temperature", 0.0)),
            ignore_eos=bool(sampling.get("ignore_eos", False)),
            stop_token_ids=set(sampling.get("stop_token_ids") or ()),
            stop_strs=list(sampling.get("stop") or ()),
            is_health=bool(msg.get("is_health")),
        )
        if req.is_health and self.released:
            # Memory released: like older SGLang, the health probe is swallowed (no output).
            return
        if req.max_new_tokens <= 0:
            self._out([(req.rid, [], {"type": "length", "length": 0})])
            return
        self.waiting.append(req)

    def _abort(self, rid: str, abort_all: bool) -> None:
        items: list[tuple[str, list[int], dict[str, Any] | None]] = []

        def match(r: Req) -> bool:
            return abort_all or (bool(rid) and r.rid.startswith(rid))

        kept: deque[Req] = deque()
        for r in self.waiting:
            if match(r):
                items.append((r.rid, [], {"type": "abort", "message": "Abort in waiting queue"}))
            else:
                kept.append(r)
        self.waiting = kept
        for r in [r for r in self.running.values() if match(r)]:
            del self.running[r.rid]
            items.append((r.rid, [], {"type": "abort", "message": "Abort in running batch"}))
        self._out(items)

    def _pause(self, mode: str) -> None:
        self.pause_mode = mode
        if mode == "retract":
            # Running requests go back to the waiting queue (their KV cache is dropped).
            self.waiting.extendleft(reversed(list(self.running.values())))
            self.running.clear()

    def _control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        if op == "flush_cache":
            return {"success": not self.waiting and not self.running}
        if op == "server_info":
            return {
                **self.info(),
                "internal_states": [
                    {
                        "last_gen_throughput": self.last_gen_throughput,
                        "num_running_reqs": len(self.running),
                        "num_queue_reqs": len(self.waiting),
                        "paused": self.pause_mode,
                        "memory_released": sorted(self.released),
                    }
                ],
            }
        if op in ("release", "resume"):
            tags = args.get("tags")
            tags = list(ALL_MEMORY_TAGS) if tags is None else [str(t) for t in tags]
            if op == "release":
                self._release(tags)
            else:
                self._resume(tags)
            return {"success": True}
        return {"success": False, "message": f"unknown control op {op!r}"}

    def _weight_op(self, op: str, args: dict[str, Any]) -> dict[str, Any] | None:
        """SGLang's scheduler weight updater; None: wedged (fault), never answered."""
        if self.model is None:
            return {"success": False, "message": NO_MODEL_REFUSAL}
        sync = self._weight_sync()
        if op == "init_weights_update_group":
            ok, message = sync.init_group(args)
        elif op == "destroy_weights_update_group":
            ok, message = sync.destroy_group(str(args["group_name"]))
        elif op == "begin_weight_update":
            ok, message = sync.begin()
        elif op == "end_weight_update":
            ok, message = sync.end()
        else:
            answer = self._update_weights(args)
            if answer is None:
                return None
            ok, message = answer
        return {"success": ok, "message": message}

    def _weight_sync(self) -> WeightSync:
        if self.weight_sync is None:
            from rollout_watchdog.emulator.weight_sync import HeldWeights, WeightSync

            spec = self.config.get("weight_spec", TINY)
            held = None if spec == TINY else HeldWeights(None if spec == LEARN else spec)
            self.weight_sync = WeightSync(self.model, self.version >= WEIGHT_SESSION_SINCE, held)
        return self.weight_sync

    def _update_weights(self, args: dict[str, Any]) -> tuple[bool, str] | None:
        """Receive (blocking in the broadcast), load, flush; None: wedged by the fault."""
        sync = self._weight_sync()
        refused = sync.check_session()
        if refused is not None:
            return refused  # never joins the broadcast: rank 0 waits for us in vain
        hang = int(self.shared[SLOT_HANG_WEIGHT_UPDATE])
        if hang and HANG_STAGES[hang - 1] == "join":
            return None
        try:
            weights = sync.receive(args)
        except Exception as exc:  # noqa: BLE001 - answered, as SGLang does
            return False, f"Failed to receive weights: {exc}"
        if hang:
            return None  # received the tensors, never loads them nor answers
        ok, message = sync.load(weights, sets_version=args.get("weight_version") is not None)
        if ok and args.get("flush_cache", True) and (self.waiting or self.running):
            if self.version < FLUSH_FAILURE_ANSWERED_SINCE:
                # Before 0.5.22 the refused flush is an assert in the scheduler: the server dies.
                raise RuntimeError("flush_cache after a weight update with requests in flight")
            return False, FLUSH_REFUSED
        return ok, message

    def _release(self, tags: list[str]) -> None:
        if self.waiting or self.running:
            # SGLang asserts an idle scheduler here; the failed assert kills the server.
            raise RuntimeError(
                "release_memory_occupation called while requests are running "
                f"(running={len(self.running)}, waiting={len(self.waiting)})"
            )
        if "weights" in tags and "weights" not in self.released and self.model is not None:
            self.weights_backup = self._model_mod.backup_weights(self.model)
            self._model_mod.zero_weights(self.model)
        self.released.update(tags)

    def _resume(self, tags: list[str]) -> None:
        if "weights" in tags and "weights" in self.released and self.weights_backup:
            self._model_mod.restore_weights(self.model, self.weights_backup)
            self.weights_backup = None
        self.released.difference_update(tags)

    # ---- decode ---------------------------------------------------------------------------

    def _step(self) -> None:
        """One decode step: every running request gets one token (after the token latency)."""
        while self.waiting and len(self.running) < MAX_RUNNING_REQUESTS:
            req = self.waiting.popleft()
            self.running[req.rid] = req
        latency = self.shared[SLOT_TOKEN_LATENCY_MS] / 1000.0
        if latency > 0:
            time.sleep(latency)
        reqs = list(self.running.values())
        if self.model is None:  # --no-model
            tokens = [_placeholder_token(r.input_ids + r.output_ids) for r in reqs]
        else:
            tokens = self._model_mod.next_tokens(
                self.model,
                [r.input_ids + r.output_ids for r in reqs],
                [r.temperature for r in reqs],
            )
        items: list[tuple[str, list[int], dict[str, Any] | None]] = []
        for req, tok in zip(reqs, tokens, strict=True):
            req.output_ids.append(tok)
            reason = self._finish_reason(req, tok)
            items.append((req.rid, [tok], reason))
            if reason is not None:
                del self.running[req.rid]
        self._out(items)
        now = time.monotonic()
        self.throughput_window.append((now, len(items)))
        while self.throughput_window and self.throughput_window[0][0] < now - 1.0:
            self.throughput_window.popleft()
        span = max(now - self.throughput_window[0][0], latency, 1e-3)
        self.last_gen_throughput = sum(n for _, n in self.throughput_window) / span

    @staticmethod
    def _finish_reason(req: Req, tok: int) -> dict[str, Any] | None:
        """Same order as SGLang's Req.check_finished: length first, then EOS / stop."""
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": req.max_new_tokens}
        if len(req.input_ids) + len(req.output_ids) >= CONTEXT_LENGTH:
            return {"type": "length", "length": len(req.output_ids)}
        if not req.ignore_eos and tok == EOS_TOKEN_ID:
            return {"type": "stop", "matched": tok}
        if tok in req.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if req.stop_strs:
            text = decode(req.output_ids)
            for s in req.stop_strs:
                if s and s in text:
                    return {"type": "stop", "matched": s}
        return None


def _placeholder_token(ids: list[int]) -> int:
    """--no-model's next token: printable ASCII, a function of the context, never EOS."""
    return 32 + (sum(ids[-8:]) * 31 + len(ids)) % 95


def run_scheduler(
    recv: Connection, send: Connection, config: dict[str, Any], shared: Any
) -> None:
    """Entry point of the scheduler child process."""
    # Die with the main process, like SGLang's kill_itself_when_parent_died(). PDEATHSIG is
    # tied to the parent *thread*: the main process starts us from its main thread.
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _prctl(PR_SET_NAME, b"sglang::scheduler")
    parent_pid = int(config["parent_pid"])
    if os.getppid() != parent_pid:
        os._exit(1)  # the parent died before PDEATHSIG was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's business
    sched = Scheduler(recv, send, config, shared)
    try:
        sched._apply_flags()
        sched.load()
        send.send({"type": "ready", "pid": os.getpid(), "info": sched.info()})
        sched.event_loop()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        os._exit(0)  # the main process is gone
    except Exception as exc:  # noqa: BLE001 - any scheduler error kills the server, as in SGLang
        print(f"[emulator scheduler] Scheduler hit an exception: {exc!r}", file=sys.stderr)
        sys.stderr.flush()
        with contextlib.suppress(OSError):
            os.kill(parent_pid, signal.SIGQUIT)
        os._exit(1)
