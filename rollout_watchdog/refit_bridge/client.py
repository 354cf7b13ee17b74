"""The driver's side of the fleet: `FleetClient` talks to the coordinator (docs/protocol.md,
"The coordinator's side", clients).

Each thread that calls keeps one DEALER (libzmq's generated routing id, which starts with a
zero byte, so it is never taken for a node id) for all its calls: a ZMQ socket is not
thread-safe, so the client is, with one connection per thread (the table of them under a lock;
a dead thread's is closed when the next one is made). A call sends one `command` and waits for
the `reply` with its request id, at most `timeout_s`; a late reply of an earlier call is
dropped by its id. A call that timed out closes its thread's connection, so a command the
caller gave up on is never delivered later by a reconnect. If the connection is made again
while a call waits (the coordinator restarted), the same command is sent again with the same
request id: a coordinator that already had it answers alike.

The client pickles to its address, its key paths and its timeout only, so it can be handed to
Ray actors; the other side opens its own sockets. No socket survives a fork: a child process
makes its own (the parent's are left alone, never closed from the child).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import zmq

from rollout_watchdog.common import handshakes, protocol
from rollout_watchdog.common.errors import CommandRefused, CoordinatorUnavailable
from rollout_watchdog.common.keys import ClientKeys
from rollout_watchdog.common.lograte import DropCount
from rollout_watchdog.common.spec import EngineSpec
from rollout_watchdog.common.validate import non_negative
from rollout_watchdog.refit_bridge.stream import SILENCE_S, EventStream
from rollout_watchdog.refit_bridge.views import (
    EngineView,
    FleetEvent,
    FleetResult,
    NodeReply,
    NodeView,
    nodes_of,
)

if TYPE_CHECKING:
    from rollout_watchdog.refit_bridge.refit import Refit

log = logging.getLogger(__name__)
__all__ = ["EngineView", "EventStream", "FleetClient", "FleetEvent", "FleetResult", "NodeReply",
           "NodeView"]

# Of a command's timeout: the share the coordinator gathers node replies for (so that its
# answer, naming the nodes that did not answer, comes back before we give up), and the share
# a node waits for in-flight probes before it answers a pause.
GATHER_SHARE = 0.8
NODE_WAIT_SHARE = 0.6
POLL_INTERVAL_S = 0.2
FINISH_TIMEOUT_S = 40.0   # the default probe timeout (30 s) and some


@dataclass
class _Connection:
    """One thread's DEALER to the coordinator and its monitor (thread-only: used by the thread
    that made it; closed by any thread once that one is gone)."""

    sock: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    handshakes: int = 0     # completed on this socket: past the first, a reconnect
    failure: int | None = None   # how the last handshake failed (None: it did not)

    def heard(self, event: int) -> bool:
        """Take one monitor event; whether it was a reconnect (not the socket's first)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.handshakes += 1
            self.failure = None
            return self.handshakes > 1
        if event in handshakes.FAILED:
            self.failure = event
        return False

    def close(self) -> None:
        handshakes.close_monitored(self.sock, self.monitor)


def _send_now(sock: zmq.Socket[bytes], data: bytes) -> bool:
    """Whether libzmq took `data`. It takes none while the DEALER has no connection at all:
    between a drop and the reconnect, or once a refused handshake has closed it (the call
    waits for a connection then, and for its timeout)."""
    try:
        sock.send(data, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def split_target(target: str | None, node: str | None) -> tuple[str | None, str | None]:
    """(node, engine) for a NODE/ENGINE name (or a bare ENGINE with `node`); ValueError naming
    the problem otherwise."""
    if target is None:
        return node, None
    if "/" in target:
        target_node, _, engine = target.partition("/")
        if not target_node or not engine or "/" in engine:
            raise ValueError(f"name an engine as NODE/ENGINE, got {target!r}")
        if node is not None and node != target_node:
            raise ValueError(f"{target!r} is not on node {node!r}")
        return target_node, engine
    if node is None:
        raise ValueError(f"name the engine as NODE/ENGINE (engine ids are unique within a "
                         f"node only), got {target!r}")
    return node, target


class FleetClient:
    """A client of the coordinator at `address`. With `key` (this client's NAME.key_secret)
    and `coordinator_key` (the coordinator's public .key) the link is CURVE; a key the
    coordinator does not list hears nothing, which shows as CoordinatorUnavailable.

    Thread-safe: any number of threads may call one client at once (each gets its own
    connection, see the module docstring). `close()` ends them all."""

    def __init__(self, address: str, key: str | None = None,
                 coordinator_key: str | None = None, timeout_s: float = 5.0) -> None:
        if (key is None) != (coordinator_key is None):
            raise ValueError("give both key and coordinator_key (CURVE), or neither")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.address, self.key, self.coordinator_key = address, key, coordinator_key
        self.timeout_s = float(timeout_s)
        self._curve = None if key is None or coordinator_key is None \
            else ClientKeys.load(key, coordinator_key)
        self._bad_frames = DropCount(log, "a bad frame from the coordinator")
        self._lock = threading.Lock()
        self._pid = os.getpid()                                # under _lock
        self._conns: dict[threading.Thread, _Connection] = {}  # under _lock

    def __repr__(self) -> str:
        return f"FleetClient({self.address!r}, curve={self._curve is not None})"

    def stats(self) -> dict[str, int]:
        """What this client dropped: `bad_frames`, frames from the coordinator that were not
        a reply (undecodable, or of another kind), over all its threads."""
        return {"bad_frames": self._bad_frames.count}

    # ------------------------------------------------------------------ pickling (Ray actors)

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "key": self.key,
                "coordinator_key": self.coordinator_key, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]  # keys loaded again, on this side

    # ------------------------------------------------------------------ sockets

    def socket(self, connect: bool = True) -> zmq.Socket[bytes]:
        """A fresh DEALER for the coordinator (CURVE when keyed), connected unless told not
        to (so that a monitor can be attached first and miss no handshake). Its caller owns
        it (an event stream does)."""
        context: zmq.SyncContext = zmq.Context.instance()   # this process's
        sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if self._curve is not None:
            self._curve.apply(sock)
        if connect:
            sock.connect(self.address)
        return sock

    def request(self, command: protocol.Command, wait_s: float | None = None
                ) -> protocol.Reply:
        """Send `command`, return its reply (an error reply included); CoordinatorUnavailable
        when none comes within `wait_s` (default: the client's timeout) or the connection
        fails (never a raw ZeroMQ error); CommandRefused, code TOO_BIG (BAD_ARGS: a NaN, say)."""
        wait = self.timeout_s if wait_s is None else wait_s
        try:
            data = protocol.encode(command)
        except protocol.ProtocolError as exc:   # (20,000 members named in one refit_commit)
            raise CommandRefused(f"the {command.cmd} command cannot be sent: {exc}",
                                 code=protocol.unsendable_code(exc)) from None
        deadline = time.monotonic() + wait
        try:
            conn = self._connection()
        except zmq.ZMQError as exc:   # an address ZeroMQ refuses, no file descriptor left
            raise CoordinatorUnavailable(f"cannot connect to the coordinator at "
                                         f"{self.address}: {exc}") from None
        try:
            while conn.monitor.poll(0):   # what happened since the last call
                conn.heard(handshakes.read_event(conn.monitor).event)
            sent = _send_now(conn.sock, data)   # queued until the connection is made
            poller = zmq.Poller()
            poller.register(conn.sock, zmq.POLLIN)
            poller.register(conn.monitor, zmq.POLLIN)
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if conn.monitor in ready:
                    event = handshakes.read_event(conn.monitor).event
                    # connected again (the first send may be lost), or at last
                    if conn.heard(event) or (not sent and event == zmq.EVENT_HANDSHAKE_SUCCEEDED):
                        sent = _send_now(conn.sock, data)
                if conn.sock in ready:
                    reply = self._decode(conn.sock.recv())
                    if reply is not None and reply.request_id == command.request_id:
                        return reply
        except zmq.ZMQError as exc:   # the connection broke (never a raw ZeroMQ error out)
            self._drop(conn)
            raise CoordinatorUnavailable(f"the connection to the coordinator at "
                                         f"{self.address} failed: {exc}") from None
        except BaseException:
            self._drop(conn)
            raise
        self._drop(conn)   # the command must not go out later, on a reconnect
        hint = handshakes.failed_handshake_hint(conn.failure, self._curve is not None)
        why = f" ({hint})" if hint else ""
        # (rounded: a paged call waits what is left of its timeout, 0.499999 s of 0.5 s)
        raise CoordinatorUnavailable(f"no answer from the coordinator at {self.address} "
                                     f"within {round(wait, 3):g} s{why}")

    def _connection(self) -> _Connection:
        """The calling thread's connection, made on its first call (and after a fork)."""
        me = threading.current_thread()
        with self._lock:
            if self._pid != os.getpid():   # a forked child: the parent's are not ours
                self._pid, self._conns = os.getpid(), {}
            conn = self._conns.get(me)
            if conn is not None:
                return conn
            gone = [t for t in self._conns if not t.is_alive()]
            dead = [self._conns.pop(t) for t in gone]
        for old in dead:
            old.close()
        sock = self.socket(connect=False)
        conn = _Connection(sock, sock.get_monitor_socket(handshakes.MONITORED))
        try:
            sock.connect(self.address)
        except zmq.ZMQError:
            conn.close()
            raise
        with self._lock:
            self._conns[me] = conn
        return conn

    def _drop(self, conn: _Connection) -> None:
        with self._lock:
            mine = self._conns.get(threading.current_thread()) is conn
            if mine:
                del self._conns[threading.current_thread()]
        if mine:
            conn.close()

    def close(self) -> None:
        """Close every thread's connection (call it once no thread uses the client; a later
        call makes a new one)."""
        with self._lock:
            conns = list(self._conns.values()) if self._pid == os.getpid() else []
            self._conns = {}
        for conn in conns:
            conn.close()

    def __enter__(self) -> FleetClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _decode(self, data: bytes) -> protocol.Reply | None:
        """The reply in `data`; None (counted in `stats()`) for a bad frame: the wait goes on."""
        try:
            message = protocol.decode(data)
        except protocol.ProtocolError as exc:
            self._bad_frames.drop(str(exc))
            return None
        if not isinstance(message, protocol.Reply):
            self._bad_frames.drop(f"a {message.KIND!r} message, not a reply")
            return None
        return message

    def call(self, cmd: str, args: dict[str, Any] | None = None, *, node: str | None = None,
             engine: str | None = None, timeout_s: float | None = None) -> tuple[str, Any]:
        """(request id, result) of one command; CommandRefused on an error reply. The command
        carries a share of the timeout, so its answer arrives before we give up: the time
        the coordinator gathers the replies of a command it forwards to nodes, and the bound
        on holding any back after its restart."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not wait > 0:
            raise ValueError(f"timeout_s must be > 0, got {wait!r}")
        command = protocol.Command(uuid.uuid4().hex, cmd, args or {}, node=node, engine=engine,
                                   timeout_s=wait * GATHER_SHARE)
        reply = self.request(command, wait)
        if reply.status != "ok":
            result = reply.result if isinstance(reply.result, dict) else {}
            nodes, missing = result.get("nodes"), result.get("missing")
            raise CommandRefused(reply.reason or "refused",
                                 replies=nodes if isinstance(nodes, dict) else None,
                                 missing=missing if isinstance(missing, list) else None,
                                 code=reply.known_code, result=reply.result)
        return command.request_id, reply.result

    # ------------------------------------------------------------------ the fleet view

    def status(self, node: str | None = None, timeout_s: float | None = None
               ) -> dict[str, Any]:
        """The coordinator's fleet view as JSON (what `status --coordinator --json` prints),
        fetched a page at a time (a big fleet's view exceeds one message), all within one
        deadline."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        nodes: list[Any] = []
        after: str | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CoordinatorUnavailable(f"the fleet view from {self.address} did not "
                                             f"arrive within {wait:g} s")
            _, result = self.call("status", {} if after is None else {"after": after},
                                  node=node, timeout_s=left)
            nodes_of(result)  # checked: a view, or RolloutWatchdogError
            nodes.extend(result["nodes"])
            after = result.get("next")
            if not isinstance(after, str):
                return {"nodes": nodes}

    def nodes(self, node: str | None = None, timeout_s: float | None = None) -> list[NodeView]:
        """Every node the coordinator knows (or `node`), reachable or not, with its engines."""
        return nodes_of(self.status(node, timeout_s))

    def engines(self, node: str | None = None, timeout_s: float | None = None
                ) -> list[EngineView]:
        """Every engine the coordinator knows (of `node` only, if given), reachable or not."""
        return [e for n in self.nodes(node, timeout_s) for e in n.engines]

    def wait_until(self, predicate: Callable[[list[EngineView]], bool], timeout_s: float,
                   interval_s: float = POLL_INTERVAL_S) -> list[EngineView]:
        """Poll the fleet view until `predicate` holds (returns that view); TimeoutError when
        it does not within `timeout_s` (a coordinator away meanwhile is waited for too)."""
        deadline = time.monotonic() + non_negative("timeout_s", timeout_s)   # (NaN: forever)
        last: list[EngineView] | None = None
        problem = ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                last = self.engines(timeout_s=min(self.timeout_s, left))
            except CoordinatorUnavailable as exc:
                problem = f"; last error: {exc}"
            else:
                if predicate(last):
                    return last
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
        seen = "no answer" if last is None else ", ".join(
            f"{e.name}={e.state}" for e in last) or "no engines"
        raise TimeoutError(f"the condition did not hold within {timeout_s:g} s (last view: "
                           f"{seen}{problem})")

    # ------------------------------------------------------------------ commands

    def command(self, cmd: str, target: str | None = None, *, node: str | None = None,
                all: bool = False, args: dict[str, Any] | None = None,
                timeout_s: float | None = None) -> FleetResult:
        """Any node command for NODE/ENGINE (`target`), or with `all` every engine of `node`,
        or of every reachable node; the per-node answers, or CommandRefused naming each node
        that answered an error or did not answer in time."""
        node, engine = split_target(target, node)
        if all and engine is not None:
            raise ValueError("name an engine or all, not both")
        if not all and engine is None:
            raise ValueError("name an engine (NODE/ENGINE), or all of them (all=True, --all; "
                             "node=, --node narrows them to one node)")
        request_id, result = self.call(cmd, {**(args or {}), **({"all": True} if all else {})},
                                       node=node, engine=engine, timeout_s=timeout_s)
        return FleetResult.from_json(request_id, result)

    def pause(self, target: str | None = None, *, node: str | None = None, all: bool = False,
              deadline_s: float | None = None, timeout_s: float | None = None,
              deadline: float | None = None) -> FleetResult:
        """Pause deep probes (of NODE/ENGINE; with `all`, or `node` alone, every engine of
        `node`; with `all` alone, of every reachable node); returns once every node named has
        no probe in flight (so none overlaps an offload or refit that follows). Probing comes
        back by itself after `deadline_s` (`deadline`, as the CLI's --deadline; the node's
        default: 600 s)."""
        if deadline is not None:
            if deadline_s is not None:
                raise ValueError("give deadline_s or deadline (the same), not both")
            deadline_s = deadline
        wait = self.timeout_s if timeout_s is None else timeout_s
        args: dict[str, Any] = {"wait_s": wait * NODE_WAIT_SHARE}
        if deadline_s is not None:
            args["deadline_s"] = deadline_s
        every = all or (target is None and node is not None)   # (`node` alone: all of it)
        return self.command("pause", target, node=node, all=every, args=args, timeout_s=wait)

    def resume(self, target: str | None = None, *, node: str | None = None, all: bool = False,
               timeout_s: float | None = None) -> FleetResult:
        """Resume deep probes (of NODE/ENGINE; with `all`, or `node` alone, every engine of
        `node`; with `all` alone, of every reachable node)."""
        every = all or (target is None and node is not None)
        return self.command("resume", target, node=node, all=every, timeout_s=timeout_s)

    def restart(self, target: str, *, node: str | None = None,
                timeout_s: float | None = None) -> FleetResult:
        """Kill the engine (if running) and relaunch it at once."""
        return self.command("restart", target, node=node, timeout_s=timeout_s)

    def stop(self, target: str, *, node: str | None = None,
             timeout_s: float | None = None) -> FleetResult:
        """Kill the engine and keep it down until restart (reset does not relaunch it)."""
        return self.command("stop", target, node=node, timeout_s=timeout_s)

    def reset(self, target: str, *, node: str | None = None,
              timeout_s: float | None = None) -> FleetResult:
        """Clear the engine's restart budget; a failed engine is relaunched."""
        return self.command("reset", target, node=node, timeout_s=timeout_s)

    # ------------------------------------------------------------------ engines at run time

    def launch(self, node_id: str, spec: EngineSpec | Mapping[str, Any],
               wait_s: float | None = None, timeout_s: float | None = None) -> EngineView:
        """Launch an engine on node `node_id` (its daemon supervises it like a configured one,
        and keeps it across its own restarts until `remove`); its view. With `wait_s`, returns
        once it is healthy, else TimeoutError. A refusal (a spec error naming the field, an
        id, port or GPU another engine of the node holds) raises CommandRefused."""
        from rollout_watchdog.refit_bridge.launching import launch_engine
        return launch_engine(self, node_id, spec, wait_s, timeout_s)

    def remove(self, target: str, *, node: str | None = None, wait_s: float | None = None,
               timeout_s: float | None = None) -> FleetResult:
        """Stop a launched engine, NODE/ENGINE (its whole tree), and forget it. With `wait_s`,
        returns once it is gone (CommandRefused if it is not within `wait_s`). A configured
        or registered engine is refused (CommandRefused)."""
        from rollout_watchdog.refit_bridge.launching import remove_engine
        return remove_engine(self, target, node, wait_s, timeout_s)

    # ------------------------------------------------------------------ refits

    def refit(self, version: str, lease_s: float = 30.0, timeout_s: float = 600.0,
              backend: str = "nccl", master_address: str | None = None) -> Refit:
        """`with fleet.refit(version) as refit:` takes the refit lock, (re)builds the
        weight-update group as needed; `refit.update_weights(named_tensors)` broadcasts;
        leaving the block commits (see refit_bridge/refit.py)."""
        from rollout_watchdog.refit_bridge.refit import Refit
        return Refit(self, version, lease_s=lease_s, timeout_s=timeout_s, backend=backend,
                     master_address=master_address)

    def prepare_for_generation(self, timeout_s: float | None = None) -> FleetResult:
        """Before a rollout phase (after the engines were woken up): deep probes resume on
        every reachable node. Named as the RL frameworks name this hook. A node that does not
        answer (one that died, before the coordinator's node timeout calls it unreachable) is
        named in the result's `missing` and a warning, not raised: a rollout loop goes on
        without it, as a refit does."""
        return _sparing_silent_nodes(lambda: self.resume(all=True, timeout_s=timeout_s))

    def finish_generation(self, deadline_s: float | None = None,
                          timeout_s: float = FINISH_TIMEOUT_S) -> FleetResult:
        """After a rollout phase (before offload or refit): deep probes pause fleet-wide, once
        in-flight probes ended (a probe may take its whole 30 s timeout), so none runs against
        released memory. They stay paused through refits until prepare_for_generation().
        A node that does not answer is named in `missing`, as for prepare_for_generation()."""
        return _sparing_silent_nodes(
            lambda: self.pause(all=True, deadline_s=deadline_s, timeout_s=timeout_s))

    # ------------------------------------------------------------------ events

    def events(self, resume: bool = True, *, idle_s: float | None = None,
               silence_s: float | None = None, wake: zmq.Socket[bytes] | None = None
               ) -> EventStream:
        """The fleet's events as FleetEvent objects, each once, following the coordinator
        across its restarts (see EventStream)."""
        return EventStream(self, resume=resume, idle_s=idle_s,
                           silence_s=SILENCE_S if silence_s is None else silence_s, wake=wake)


    # ------------------------------------------------------------------ the router

    def wait_router_synced(self, timeout_s: float, interval_s: float = POLL_INTERVAL_S
                           ) -> list[str]:
        """Wait until the router lists exactly the serving engines of reachable nodes in the
        fleet view (and `ping` says `router.synced`): a commit, a relaunch or a death reaches
        the router a moment after the view. Returns the URLs the router lists; `[]` at once
        when the coordinator has no router. TimeoutError, naming what the router listed and
        what it should list, when not in sync within `timeout_s` (a coordinator away
        meanwhile is waited for too)."""
        from rollout_watchdog.refit_bridge.router_wait import wait_router_synced

        return wait_router_synced(self, timeout_s, interval_s)


def _sparing_silent_nodes(fan_out: Callable[[], FleetResult]) -> FleetResult:
    try:
        return fan_out()
    except CommandRefused as exc:
        result = FleetResult.of_silent_nodes(exc)
        if result is None:
            raise
        log.warning("%s (left out of this phase)", exc.reason)
        return result
