"""The coordinator's read-only commands, answered from its own state (nothing to remember for
a repeat): `status` (the fleet view, a page at a time: `after`, `next`) and `ping` (its health
and counters)."""

from __future__ import annotations

import time
from collections import Counter
from typing import Protocol

from rollout_watchdog.agent.relay import Relay
from rollout_watchdog.common import protocol
from rollout_watchdog.refit_bridge.fleet import FleetView
from rollout_watchdog.refit_bridge.router_sync import RouterSync
from rollout_watchdog.refit_bridge.service import RefitService

COMMANDS = ("status", "ping")


class Hub(Protocol):
    boot: str
    view: FleetView
    relay: Relay
    refit: RefitService
    router: RouterSync | None
    bad_messages: Counter[str]


def answer(hub: Hub, cmd: protocol.Command) -> protocol.Reply:
    if cmd.cmd == "status":
        if cmd.node is not None and cmd.node not in hub.view.nodes:
            return error(cmd, f"unknown node {cmd.node!r}", protocol.UNKNOWN_NODE)
        after = cmd.args.get("after")
        if after is not None and not isinstance(after, str):
            return error(cmd, f"'after' must be a node id, got {str(after)[:40]!r}",
                         protocol.BAD_ARGS)
        view = hub.view.status(cmd.node, after)
        for node in view["nodes"]:
            for engine in node["engines"]:
                hub.refit.book.decorate(node["node_id"], engine)
        return protocol.Reply(cmd.request_id, "ok", None, view)
    relay = hub.relay
    return protocol.Reply(cmd.request_id, "ok", None, {
        "coordinator": hub.boot, "nodes": len(hub.view.nodes),
        "reachable": len(hub.view.reachable()), "subscribers": len(relay.subscribers),
        "bad_messages": {**hub.bad_messages, **hub.view.refused},
        "relay_skipped": relay.skipped_behind,
        "relay_behind": max((relay.end - sub.cursor for sub in relay.subscribers.values()),
                            default=0),
        "refit": hub.refit.status(time.monotonic()),
        "router": None if hub.router is None else hub.router.status()})


def error(cmd: protocol.Command, reason: str, code: str) -> protocol.Reply:
    return protocol.Reply(cmd.request_id, "error", reason, None, code)
