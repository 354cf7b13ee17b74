"""The coordinator (DESIGN.md, "Refit bridge"; docs/protocol.md, "The coordinator's side"): the
fleet's policy, and the composition that serves it.

The transport is the agent's hub (`agent.hub.Hub`: the ROUTER that nodes and clients connect
to, its loop, ACKs, the journal, the relay to subscribers, the fan-out of commands). This class
builds one and is its policy (`agent.hub_policy.Policy`): it holds the fleet view
(`fleet.FleetView`), dispatches clients' commands (`queries`, `service` for the refit lock and
weight versions, or fanned out to nodes), restarts every part of a multi-node group when one
part fails, keeps the router to the engines that serve (`router_sync`), and samples the
metrics. Embeddable in a driver (`with Coordinator(bind=...)`: a thread of its own) or
standalone (`rollout-watchdog coordinator`: `run()` in the main thread); either way `stop()`
and `reload_keys()` go down the hub's pipe (`agent.hub_thread.HubThread`) and act at once.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType

from rollout_watchdog.agent.fanout import (
    DEFAULT_TIMEOUT_S,
    Fanout,
    Gathering,
    encode_reply,
    shortened,
)
from rollout_watchdog.agent.hub import HEARTBEAT_S, Hub
from rollout_watchdog.agent.hub_thread import STOP_TIMEOUT_S, HubThread
from rollout_watchdog.agent.journal import Journal
from rollout_watchdog.agent.relay import Relayed
from rollout_watchdog.agent.security import check_bind
from rollout_watchdog.common import protocol
from rollout_watchdog.common.handshakes import HANDSHAKE_TIMEOUT_S
from rollout_watchdog.common.validate import bracket_host
from rollout_watchdog.refit_bridge import membership, queries
from rollout_watchdog.refit_bridge import service as refit
from rollout_watchdog.refit_bridge.durable import STATE_WRITE_TIMEOUT_S
from rollout_watchdog.refit_bridge.fleet import NODE_TIMEOUT_S, FleetView, node_event
from rollout_watchdog.refit_bridge.held import MAX_HELD, HeldCommands, waits_for_the_view
from rollout_watchdog.refit_bridge.lease_end import RELEASE_TIMEOUT_S
from rollout_watchdog.refit_bridge.lock import HOLDER_TIMEOUT_S
from rollout_watchdog.refit_bridge.metrics import CoordinatorMetrics
from rollout_watchdog.refit_bridge.refit_call import Finish
from rollout_watchdog.refit_bridge.router_sync import VERIFY_S, RouterSync
from rollout_watchdog.refit_bridge.views import COORDINATOR_BOOT_PREFIX

log = logging.getLogger(__name__)
# Node commands that name one node: never fanned out to every node (an engine launched on all).
ONE_NODE = ("launch",)
OWED_RESUME_S = 86_400.0   # a node away longer lifted a refit's pause by itself (its longest)
OWED_PER_NODE = 64         # the newest refits' resumes owed to one node
HELD_BUDGET_S = 0.05   # of a sweep, the most spent running held commands (the rest: the next)


class Coordinator:
    """The fleet's coordinator; see the module docstring. Not thread-safe: talk to it over
    ZMQ (`start`, `stop`, `reload_keys` excepted)."""

    def __init__(self, bind: str, keys: str | None = None, insecure: bool = False,
                 router_url: str | None = None, state_dir: str | None = None,
                 node_timeout_s: float = NODE_TIMEOUT_S, heartbeat_s: float = HEARTBEAT_S,
                 holder_timeout_s: float = HOLDER_TIMEOUT_S,
                 state_write_timeout_s: float = STATE_WRITE_TIMEOUT_S,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 route_after_first_refit: bool = False,
                 router_verify_s: float = VERIFY_S,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        check_bind(bind, keys, insecure)
        self.view = FleetView(node_timeout_s)
        self.refit = refit.RefitService(state_dir, holder_timeout_s,  # raises for bad state
                                        state_write_timeout_s, route_after_first_refit)
        # (router_verify_s: how often every routed engine's own weight_version is checked)
        self.router = RouterSync(router_url, verify_s=router_verify_s) if router_url else None
        # Prometheus (`--metrics-port`; 0 picks a free port, then `metrics_port` is it)
        self.metrics = CoordinatorMetrics() if metrics_port is not None else None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self._router_members: dict[str, str | None] | None = None   # None: not started
        self._started_at = 0.0
        # Commands held back while a restarted coordinator's view is not whole yet
        # (waits_for_the_view): request id -> (client, command, when it came)
        self._held = HeldCommands()
        self._owed: dict[str, dict[str, float]] = {}   # node: refit pause owner: until when
        self._view_changed = True     # since the router was last told
        self._shared: dict[str, list[str]] | None = None   # (shared_servers, until a change)
        self.boot = f"{COORDINATOR_BOOT_PREFIX}{uuid.uuid4().hex[:12]}"
        self.hub = Hub(bind, keys, self.view, self, self.boot, state_dir, heartbeat_s,
                       handshake_timeout_s=handshake_timeout_s)
        self._serving = HubThread(self.hub)
        # the hub's, which `queries` and the metrics read here too (never replaced)
        self.relay, self.bad_messages = self.hub.relay, self.hub.bad_messages
        self.handshakes_failed = self.hub.handshakes.counts

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Bind and serve in a thread of its own; raises what the bind raised."""
        self._serving.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Stop serving at once (through the hub's pipe); waits at most `timeout_s`."""
        self._serving.stop(timeout_s)

    def __enter__(self) -> Coordinator:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def reload_keys(self) -> None:
        """Read `keys/authorized/` again, at once (SIGHUP does this for the standalone
        coordinator): a node or client added there is let in, one removed is kept out of new
        connections."""
        self._serving.reload_keys()

    def run(self, opened: Callable[[], None] | None = None) -> int:
        """Serve in this thread until SIGTERM or SIGINT (the standalone coordinator); SIGHUP
        reloads the authorized keys; `opened` once bound, the journal restored
        (`HubThread.run`)."""
        return self._serving.run(opened)

    # ------------------------------------------------------------------ the hub's

    @property
    def endpoint(self) -> str:
        """The bound endpoint once started (a port 0 resolved), else the one to bind."""
        return self.hub.endpoint

    @property
    def journal(self) -> Journal | None:
        return self.hub.journal

    @property
    def fanout(self) -> Fanout:
        return self.hub.fanout

    # ------------------------------------------------------------------ the hub's policy

    @property
    def wakeup_fd(self) -> int | None:
        return self.refit.wakeup_fd   # the refit state's writer: a write ended

    def woke(self, now: float) -> None:
        self.refit.saved(now)

    def next_deadline(self) -> float | None:
        return self.refit.next_deadline()

    def opened(self) -> None:
        if self.metrics is not None and self.metrics_port is not None:
            try:
                self.metrics_port = self.metrics.start_server(self.metrics_port,
                                                              self.metrics_host)
            except OSError as exc:
                raise ValueError(f"cannot serve metrics on {self.metrics_host}:"
                                 f"{self.metrics_port}: {exc}") from exc
            log.info("coordinator metrics on http://%s:%d/metrics",   # (0 picked a free port)
                     bracket_host(self.metrics_host), self.metrics_port)
        self._started_at = time.monotonic()

    @property
    def started_at(self) -> float:
        """When the loop began (monotonic): the view is whole a node timeout after it."""
        return self._started_at

    def closed(self) -> None:
        if self.metrics is not None:
            self.metrics.stop_server()
        if self.router is not None:
            self.router.stop()
        self.refit.close()

    def restored(self, items: list[Relayed]) -> None:
        """The nodes the journal knew: the view waits for them (`warm`), and what they resend
        of their journaled events is not new."""
        for item in items:
            if item.boot.startswith(COORDINATOR_BOOT_PREFIX):
                item.own = True   # (an earlier coordinator's word: no node's resume point)
            else:
                self.view.journaled[item.node_id] = (item.boot, item.seq + item.count - 1)
                self.view.expected.add(item.node_id)

    def changed(self) -> None:
        self._view_changed = True
        self._shared = None

    def shared_servers(self) -> dict[str, list[str]]:
        """membership.shared_urls of the view, once per change of it: every status page and
        router sync asks, and each would walk every engine of the fleet."""
        if self._shared is None:
            self._shared = membership.shared_urls(self.view)
        return self._shared

    def sweep(self, now: float) -> None:
        self.refit.tick(self, now)   # (first: a restored lease ends before held acquires run)
        self._release_held(now)
        self._pay_owed_resumes(now)
        self._sync_router()
        if self.metrics is not None:
            self.metrics.sample(self, now)

    # ------------------------------------------------------------------ commands

    # The dispatch of a client's command (the hub's `Policy.command`).
    def command(self, client: bytes, cmd: protocol.Command, now: float) -> None:
        known = self.fanout.known(cmd.request_id)
        if isinstance(known, bytes):
            self.hub.send_reply(client, known)
            return
        if isinstance(known, Gathering):   # a retry while in flight: answer the new socket
            known.client = client
            return
        if self._held.retried(client, cmd):
            return
        if not self._held.holds(cmd, waits_for_the_view(self.view, self._started_at, now)(cmd)):
            self._dispatch(client, cmd, now)
        elif self._held.full():
            self.reply(client, queries.error(cmd, f"not run: {MAX_HELD} commands are held back "
                                             "already, for nodes not back since the restart",
                                             protocol.BUSY))
        else:
            self._held.hold(client, cmd, now)

    @property
    def held_back(self) -> int:
        """The commands held back now (refit_bridge/held.py), for `ping`."""
        return len(self._held)

    def _release_held(self, now: float) -> None:
        """Run the held commands that are due (with what is left of their time), and refuse
        those queued too long behind others, within HELD_BUDGET_S of this sweep."""
        if not self._held:
            return
        waits = waits_for_the_view(self.view, self._started_at, now)
        budget = time.monotonic() + HELD_BUDGET_S
        for held, run in self._held.due(now, waits):
            client, cmd, since = held.client, held.cmd, held.since
            if not run:
                self.reply(client, queries.error(cmd, f"not run: held back {now - since:.1f} s "
                                                 "(half its time) behind earlier commands for "
                                                 "nodes not back since the restart",
                                                 protocol.BUSY))
            else:
                if waits(cmd):
                    log.info("%s held %.1f s (half its time) for nodes not back since the "
                             "restart: handled with those back", cmd.cmd, now - since)
                self._dispatch(client, shortened(cmd, now - since, timeout=True), now)
            if time.monotonic() >= budget:
                return

    def _dispatch(self, client: bytes, cmd: protocol.Command, now: float) -> None:
        if cmd.cmd in queries.COMMANDS:  # read-only: nothing to remember for a repeat
            self.hub.send_reply(client, encode_reply(queries.answer(self, cmd)))   # (TOO_BIG)
            return
        if cmd.cmd in refit.COMMANDS:
            self.refit.handle(self, client, cmd, now)
            return
        if cmd.node is not None and cmd.node not in self.view.nodes:
            self.reply(client, queries.error(cmd, f"unknown node {cmd.node!r} (known: "
                                       f"{', '.join(sorted(self.view.nodes)) or 'none'})",
                                       protocol.UNKNOWN_NODE))
            return
        if cmd.node is not None and not self.view.nodes[cmd.node].reachable:
            last = time.strftime("%H:%M:%S", time.localtime(self.view.nodes[cmd.node].last_seen))
            self.reply(client, queries.error(cmd, f"node {cmd.node!r} is unreachable (last seen "
                                            f"{last})", protocol.NODE_UNREACHABLE))
            return
        if cmd.node is None and cmd.cmd in ONE_NODE:
            self.reply(client, queries.error(cmd, f"{cmd.cmd} goes to one node: name it "
                                             "('node')", protocol.BAD_ARGS))
            return
        live = self.refit.live_lease   # a refit's pause stays until its end
        if cmd.cmd == "resume" and cmd.args.get("owner") is None and live is not None:
            cmd = replace(cmd, args={**cmd.args, "keep": live.pause_owner})
        targets = [cmd.node] if cmd.node is not None else self.view.reachable()
        self.gather(client, _with_wait(cmd), targets, now)

    def gather(self, client: bytes | None, cmd: protocol.Command, targets: list[str],
               now: float, finish: Finish | None = None) -> None:
        """Fan `cmd` out to `targets` (`Hub.gather`)."""
        self.hub.gather(client, cmd, targets, now, finish)

    def reply(self, client: bytes, reply: protocol.Reply) -> None:
        """Answer `client`; the reply is kept for a repeat of its request id."""
        self.hub.reply(client, reply)

    def weights_changed(self) -> None:
        self._view_changed = True
        self._sync_router()

    def resume_owed(self, owner: str, nodes: list[str]) -> None:
        """A refit's resume did not reach these nodes (unreachable, or no answer in time): it
        is sent again once each is reachable (else its pause held until its deadline, and a
        later refit's pause extended it)."""
        until = time.monotonic() + OWED_RESUME_S
        for node in nodes:
            owed = self._owed.setdefault(node, {})
            owed[owner] = until
            if len(owed) > OWED_PER_NODE:   # (a node gone for good: refit after refit)
                del owed[next(iter(owed))]

    def _pay_owed_resumes(self, now: float) -> None:
        for node in [n for n in self._owed if n in self.view.nodes and
                     self.view.nodes[n].reachable]:
            for owner, until in self._owed.pop(node).items():
                if now < until:
                    resume = protocol.Command(f"refit-resume-{uuid.uuid4().hex}", "resume",
                                              {"all": True, "owner": owner}, None, None,
                                              RELEASE_TIMEOUT_S)
                    self.gather(None, resume, [node], now)

    def refit_ended(self, outcome: str, duration_s: float) -> None:
        if self.metrics is not None:
            self.metrics.refit_ended(outcome, duration_s)

    def _sync_router(self) -> None:
        """The router's membership, once the fleet view is warm (a restarted coordinator must
        not empty the router before its nodes are back)."""
        if self.router is None:
            return
        if self._router_members is None:
            if not self.view.warm(self._started_at, time.monotonic()):
                return
        elif not self._view_changed:   # (a sweep must not walk every engine for nothing)
            return
        self._view_changed = False
        members = membership.router_members(self.view, self.refit.book, self.shared_servers())
        if members != self._router_members:
            first = self._router_members is None
            self._router_members = members
            self.router.set_desired(members)
            if first:
                self.router.start()

    # ------------------------------------------------------------------ group restarts

    def restarts(self, peer: str, msg: protocol.Event) -> list[tuple[str, str]]:
        """The group parts a new event of `peer` makes the coordinator restart."""
        if msg.seq <= self.view.nodes[peer].snapshot_seq:
            return []  # older than the HELLO's snapshot: whoever heard it first acted on it
        return self.view.group_restarts(peer, msg.event)

    def group_restart(self, node: str, engine: str, cause: protocol.Event) -> None:
        """Restart another part of a multi-node engine whose part failed."""
        failed = f"{cause.node_id}/{cause.event.get('engine')}"
        detail = (f"part {failed} failed ({cause.event.get('cause')}): restarting the whole "
                  "group")
        log.warning("group restart of %s/%s: %s", node, engine, detail)
        event = node_event(node, "group_restart", detail, time.time())
        event["engine"] = engine
        self.hub.own_events([event])
        cmd = protocol.Command(f"group-{uuid.uuid4().hex}", "restart", {}, node, engine)
        self.gather(None, cmd, [node], time.monotonic())


def _with_wait(cmd: protocol.Command) -> protocol.Command:
    """A pause waits on each node for its in-flight probes: ask the node to answer (done or
    not) before the gathering's deadline, so a late node is named rather than missing."""
    if cmd.cmd != "pause" or "wait_s" in cmd.args:
        return cmd
    timeout = cmd.timeout_s or DEFAULT_TIMEOUT_S
    args = {**cmd.args, "wait_s": max(0.0, timeout - min(1.0, timeout / 5))}
    return protocol.Command(cmd.request_id, cmd.cmd, args, cmd.node, cmd.engine, cmd.timeout_s)
