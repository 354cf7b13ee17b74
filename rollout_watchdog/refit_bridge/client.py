"""The driver's side of the fleet: `FleetClient` talks to the coordinator (docs/protocol.md,
"The coordinator's side", clients).

Every call opens its own DEALER (libzmq's generated routing id, which starts with a zero byte,
so it is never taken for a node id), sends one `command` and waits for the `reply` with its
request id, at most `timeout_s`. A fresh socket per call makes the client safe to share between
threads, and a call that timed out leaves no stale reply behind for the next. If the connection
is made again while a call waits (the coordinator restarted), the same command is sent again
with the same request id: a coordinator that already had it answers alike.

The client pickles to its address, its key paths and its timeout only, so it can be handed to
Ray actors; the other side opens its own sockets.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from rollout_watchdog.common import protocol
from rollout_watchdog.common.errors import CommandRefused, CoordinatorUnavailable
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

__all__ = ["EngineView", "EventStream", "FleetClient", "FleetEvent", "FleetResult", "NodeReply",
           "NodeView"]

# Of a command's timeout: the share the coordinator gathers node replies for (so that its
# answer, naming the nodes that did not answer, comes back before we give up), and the share
# a node waits for in-flight probes before it answers a pause.
GATHER_SHARE = 0.8
NODE_WAIT_SHARE = 0.6
POLL_INTERVAL_S = 0.2
FINISH_TIMEOUT_S = 40.0   # the default probe timeout (30 s) and some
_AUTH_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
_MONITORED = zmq.EVENT_HANDSHAKE_SUCCEEDED | _AUTH_FAILED[0] | _AUTH_FAILED[1] | _AUTH_FAILED[2]


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
    coordinator does not list hears nothing, which shows as CoordinatorUnavailable."""

    def __init__(self, address: str, key: str | None = None,
                 coordinator_key: str | None = None, timeout_s: float = 5.0) -> None:
        if (key is None) != (coordinator_key is None):
            raise ValueError("give both key and coordinator_key (CURVE), or neither")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.address, self.key, self.coordinator_key = address, key, coordinator_key
        self.timeout_s = float(timeout_s)
        self._curve: tuple[bytes, bytes, bytes] | None = None
        if key is not None and coordinator_key is not None:
            public, secret = zmq.auth.load_certificate(key)
            server, _ = zmq.auth.load_certificate(coordinator_key)
            if secret is None:
                raise ValueError(f"{key} holds no secret key: give this client's "
                                 "NAME.key_secret")
            self._curve = (public, secret, server)
        self._ctx: zmq.SyncContext = zmq.Context.instance()
        self.weight_group: Any = None   # the last refit's group (this process only)

    def __repr__(self) -> str:
        return f"FleetClient({self.address!r}, curve={self._curve is not None})"

    # ------------------------------------------------------------------ pickling (Ray actors)

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "key": self.key,
                "coordinator_key": self.coordinator_key, "timeout_s": self.timeout_s}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]  # keys loaded again, on this side

    # ------------------------------------------------------------------ sockets

    def socket(self, connect: bool = True) -> zmq.Socket[bytes]:
        """A fresh DEALER for the coordinator (CURVE when keyed), connected unless told not
        to (so that a monitor can be attached first and miss no handshake)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if self._curve is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = self._curve
        if connect:
            sock.connect(self.address)
        return sock

    def request(self, command: protocol.Command, wait_s: float | None = None
                ) -> protocol.Reply:
        """Send `command`, return its reply (an error reply included); CoordinatorUnavailable
        when none comes within `wait_s` (default: the client's timeout)."""
        wait = self.timeout_s if wait_s is None else wait_s
        data = protocol.encode(command)
        deadline = time.monotonic() + wait
        sock = self.socket(connect=False)
        monitor = sock.get_monitor_socket(_MONITORED)
        handshakes, refused = 0, False
        try:
            sock.connect(self.address)
            sock.send(data, zmq.NOBLOCK)  # queued until the connection is made
            poller = zmq.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            while (left := deadline - time.monotonic()) > 0:
                ready = dict(poller.poll(max(1, int(left * 1000))))
                if monitor in ready:
                    event = recv_monitor_message(monitor)["event"]
                    refused = refused or event in _AUTH_FAILED
                    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        handshakes += 1
                        if handshakes > 1:  # connected again: the first send may be lost
                            with contextlib.suppress(zmq.Again):
                                sock.send(data, zmq.NOBLOCK)
                if sock in ready:
                    reply = self._decode(sock.recv())
                    if reply is not None and reply.request_id == command.request_id:
                        return reply
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        why = " (the CURVE handshake failed: is this client's key authorized?)" if refused \
            else ""
        raise CoordinatorUnavailable(f"no answer from the coordinator at {self.address} "
                                     f"within {wait:g} s{why}")

    @staticmethod
    def _decode(data: bytes) -> protocol.Reply | None:
        try:
            message = protocol.decode(data)
        except protocol.ProtocolError:
            return None  # not ours to answer; the wait goes on
        return message if isinstance(message, protocol.Reply) else None

    def call(self, cmd: str, args: dict[str, Any] | None = None, *, node: str | None = None,
             engine: str | None = None, timeout_s: float | None = None,
             gather: bool = False) -> tuple[str, Any]:
        """(request id, result) of one command; CommandRefused on an error reply. With
        `gather` (a command the coordinator forwards to nodes), it is told to gather the
        replies for a share of the timeout, so its answer arrives before we give up."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        if not wait > 0:
            raise ValueError(f"timeout_s must be > 0, got {wait!r}")
        command = protocol.Command(uuid.uuid4().hex, cmd, args or {}, node=node, engine=engine,
                                   timeout_s=wait * GATHER_SHARE if gather else None)
        reply = self.request(command, wait)
        if reply.status != "ok":
            result = reply.result if isinstance(reply.result, dict) else {}
            nodes, missing = result.get("nodes"), result.get("missing")
            raise CommandRefused(reply.reason or "refused",
                                 replies=nodes if isinstance(nodes, dict) else None,
                                 missing=missing if isinstance(missing, list) else None)
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
        deadline = time.monotonic() + timeout_s
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
            raise ValueError("name an engine (NODE/ENGINE), or all=True (node= narrows it "
                             "to one node)")
        request_id, result = self.call(cmd, {**(args or {}), **({"all": True} if all else {})},
                                       node=node, engine=engine, timeout_s=timeout_s,
                                       gather=True)
        return FleetResult.from_json(request_id, result)

    def pause(self, target: str | None = None, *, node: str | None = None, all: bool = False,
              deadline_s: float | None = None, timeout_s: float | None = None) -> FleetResult:
        """Pause deep probes; returns once every node named has no probe in flight (so none
        overlaps an offload or refit that follows). Probing comes back by itself after
        `deadline_s` (the node's default: 600 s)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        args: dict[str, Any] = {"wait_s": wait * NODE_WAIT_SHARE}
        if deadline_s is not None:
            args["deadline_s"] = deadline_s
        return self.command("pause", target, node=node, all=all, args=args, timeout_s=wait)

    def resume(self, target: str | None = None, *, node: str | None = None, all: bool = False,
               timeout_s: float | None = None) -> FleetResult:
        """Resume deep probes (of NODE/ENGINE, or with `all` of every engine of `node` or of
        every reachable node)."""
        return self.command("resume", target, node=node, all=all, timeout_s=timeout_s)

    def restart(self, target: str, *, node: str | None = None,
                timeout_s: float | None = None) -> FleetResult:
        """Kill the engine (if running) and relaunch it at once."""
        return self.command("restart", target, node=node, timeout_s=timeout_s)

    def stop(self, target: str, *, node: str | None = None,
             timeout_s: float | None = None) -> FleetResult:
        """Kill the engine and keep it down until restart or reset."""
        return self.command("stop", target, node=node, timeout_s=timeout_s)

    def reset(self, target: str, *, node: str | None = None,
              timeout_s: float | None = None) -> FleetResult:
        """Clear the engine's restart budget; a failed engine is relaunched."""
        return self.command("reset", target, node=node, timeout_s=timeout_s)

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
        every reachable node. Named as the RL frameworks name this hook."""
        return self.resume(all=True, timeout_s=timeout_s)

    def finish_generation(self, deadline_s: float | None = None,
                          timeout_s: float = FINISH_TIMEOUT_S) -> FleetResult:
        """After a rollout phase (before offload or refit): deep probes pause fleet-wide, once
        in-flight probes ended (a probe may take its whole 30 s timeout), so none runs against
        released memory. They stay paused through refits until prepare_for_generation()."""
        return self.pause(all=True, deadline_s=deadline_s, timeout_s=timeout_s)

    # ------------------------------------------------------------------ events

    def events(self, resume: bool = True, *, idle_s: float | None = None,
               silence_s: float | None = None) -> EventStream:
        """The fleet's events as FleetEvent objects, each once, following the coordinator
        across its restarts (see EventStream)."""
        return EventStream(self, resume=resume, idle_s=idle_s,
                           silence_s=SILENCE_S if silence_s is None else silence_s)


    # ------------------------------------------------------------------ the router

    def wait_router_synced(self, timeout_s: float, interval_s: float = POLL_INTERVAL_S
                           ) -> list[str]:
        """Wait until the router lists exactly the serving engines of reachable nodes in the
        fleet view (and `ping` says `router.synced`): a commit, a relaunch or a death reaches
        the router a moment after the view. Returns the URLs the router lists; `[]` at once
        when the coordinator has no router. TimeoutError, naming what the router listed and
        what it should list, when not in sync within `timeout_s` (a coordinator away
        meanwhile is waited for too)."""
        from rollout_watchdog.refit_bridge.router import normalize_url

        deadline = time.monotonic() + timeout_s
        router: Any = None
        want: set[str] = set()
        while (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(CoordinatorUnavailable):
                want = {normalize_url(str(e.url)) for n in self.nodes(timeout_s=left)
                        if n.reachable for e in n.engines if e.serving and e.url}
                _, result = self.call("ping", timeout_s=min(self.timeout_s, left))
                router = result.get("router") if isinstance(result, dict) else None
                if not isinstance(router, dict):
                    return []
                desired = {normalize_url(str(url)) for url in router.get("desired") or ()}
                if router.get("synced") is True and desired == want:
                    return [str(url) for url in router.get("listed") or ()]
            time.sleep(max(0.0, min(interval_s, deadline - time.monotonic())))
        seen = "no answer from the coordinator" if router is None else (
            f"it lists {router.get('listed')}, the view routes {sorted(want)}, last error "
            f"{router.get('last_error')!r}")
        raise TimeoutError(f"the router was not in sync within {timeout_s:g} s ({seen})")
