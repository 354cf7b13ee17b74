"""The coordinator's read-only commands, answered from its own state (nothing to remember for
a repeat): `status` (the fleet view, a page at a time: `after`, `next`), `ping` (its health
and counters) and `router_urls` (the router's URLs, a page at a time). Each is declared in
`COMMANDS` (`common.commands`): its docstring is its wire spec, its arguments are checked
before it runs."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from rollout_watchdog.agent.relay import Relay
from rollout_watchdog.common import protocol
from rollout_watchdog.common.commands import Arg, Registry, text
from rollout_watchdog.common.replies import CommandError
from rollout_watchdog.refit_bridge import membership
from rollout_watchdog.refit_bridge.fleet import FleetView
from rollout_watchdog.refit_bridge.router_sync import RouterSync
from rollout_watchdog.refit_bridge.service import RefitService


class Hub(Protocol):
    boot: str
    view: FleetView
    relay: Relay
    refit: RefitService
    router: RouterSync | None
    bad_messages: Counter[str]
    handshakes_failed: Counter[str]

    @property
    def held_back(self) -> int: ...

    def shared_servers(self) -> dict[str, list[str]]: ...


Handler = Callable[[Hub, protocol.Command, dict[str, Any]], dict[str, Any]]
COMMANDS: Registry[Handler] = Registry("the coordinator")


def answer(hub: Hub, cmd: protocol.Command) -> protocol.Reply:
    """Run a query: its result, or an error with its code (BAD_ARGS: a malformed argument)."""
    try:
        spec = COMMANDS.lookup(cmd.cmd)
        result = spec.handler(hub, cmd, spec.validate(cmd.args))
    except CommandError as exc:
        return error(cmd, str(exc), exc.code or protocol.BAD_ARGS)
    return protocol.Reply(cmd.request_id, "ok", None, result)


@COMMANDS.command("status", Arg("after", text()))
def status(hub: Hub, cmd: protocol.Command, args: dict[str, Any]) -> dict[str, Any]:
    """The fleet view, a page at a time (about 512 KiB of nodes), in node id order.

    args: {"after"?: NODE: the page after that node}; the command's `node` narrows it to one
    node (unknown: UNKNOWN_NODE). result: {"nodes": [{"node_id", "reachable", "last_seen",
    "boot", "engines": [the node's engine objects, plus "weight_version", "serving",
    "reachable"]}], "next": NODE | null (not null when more follow: ask again after it)}
    """
    if cmd.node is not None and cmd.node not in hub.view.nodes:
        raise CommandError(f"unknown node {cmd.node!r}", protocol.UNKNOWN_NODE)
    view = hub.view.status(cmd.node, args["after"])
    shared = hub.shared_servers()   # (not serving: not in the router)
    for node in view["nodes"]:
        for engine in node["engines"]:
            hub.refit.book.decorate(node["node_id"], engine, node["reachable"])
            if membership.shares_a_server(engine.get("url"), shared):
                engine["serving"] = False
    return view


@COMMANDS.command("ping")
def ping(hub: Hub, cmd: protocol.Command, args: dict[str, Any]) -> dict[str, Any]:
    """The coordinator's health and counters.

    args: {}. result: {"coordinator": BOOT, "nodes", "reachable", "subscribers",
    "bad_messages": {REASON: N}, "handshakes_failed": {KIND: N} (connections dropped before
    they spoke: timeout, closed, auth, protocol), "relay_skipped", "relay_behind",
    "held_back" (commands held back until the nodes they need are back after a start), "refit":
    {"current_version", "holder": {"holder", "version", "expires_in_s"} | null} (never the
    holder's token), "router": RouterSync.status() | null}: its "listed", "desired" and
    "pending" are null when they hold more than STATUS_URLS (2,000) URLs together
    ("listed_count", "desired_count" and "pending_count" are always there): `router_urls`
    pages them.
    """
    relay = hub.relay
    return {
        "coordinator": hub.boot, "nodes": len(hub.view.nodes),
        "reachable": len(hub.view.reachable()), "subscribers": len(relay.subscribers),
        "bad_messages": {**hub.bad_messages, **hub.view.refused},
        "handshakes_failed": dict(hub.handshakes_failed),
        "relay_skipped": relay.skipped_behind,
        "relay_behind": max((relay.end - sub.cursor for sub in relay.subscribers.values()),
                            default=0),
        "held_back": hub.held_back,
        "refit": hub.refit.status(time.monotonic()),
        "router": None if hub.router is None else hub.router.status()}


@COMMANDS.command("router_urls", Arg("after", text()))
def router_urls(hub: Hub, cmd: protocol.Command, args: dict[str, Any]) -> dict[str, Any]:
    """Every URL the router lists or should list, a page at a time (STATUS_URLS), in order.

    args: {"after"?: URL: the page after that URL}. result: {"urls": [{"url", "listed",
    "desired", "weight_version", "pending"}], "next": URL | null (not null when more follow),
    "generation": N (the lists' generation, as `ping`'s router status has it: a reader whose
    pages and ping do not all have the same one read lists that changed meanwhile, and reads
    again)}; {"urls": [], "next": null, "generation": 0} for a coordinator without a router.
    """
    if hub.router is None:
        return {"urls": [], "next": None, "generation": 0}
    urls, after, generation = hub.router.urls(args["after"])
    return {"urls": urls, "next": after, "generation": generation}


def error(cmd: protocol.Command, reason: str, code: str) -> protocol.Reply:
    return protocol.Reply(cmd.request_id, "error", reason, None, code)
