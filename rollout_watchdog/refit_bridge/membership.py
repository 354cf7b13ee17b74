"""Who a refit updates, what the router must hold, and which engines wait for a refit: questions
put to the fleet view and the weight book.

They exist apart from the refit commands (service.py) because they are questions, not commands:
functions of the view and the book that change nothing, asked by the commands (a lease's members,
the deferred engines to relaunch, an uncommitted lease's URLs to put back in service) and by the
coordinator (the router's membership), and testable with a view built by hand.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import Any
from urllib.parse import urlsplit

from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge import member_pages
from rollout_watchdog.refit_bridge.fleet import FleetView
from rollout_watchdog.refit_bridge.weights import Member, WeightBook

RUNNING_STATES = {str(state) for state in EngineState if state.running}


@functools.lru_cache(maxsize=1 << 16)   # (a status page asks for every engine's)
def server_of(url: object) -> str:
    """The server a URL reaches, as one string: scheme and host in lower case, an IP address
    in its canonical form, the default port filled in, a trailing `/` dropped, and every
    loopback host one ("loopback"), so that `http://localhost:30000/` and
    `HTTP://127.0.0.1:30000` are one server."""
    try:
        parts = urlsplit(str(url).strip())
        scheme = parts.scheme.lower()
        port = parts.port if parts.port is not None else {"http": 80, "https": 443}.get(
            scheme, 0)
    except ValueError:
        return str(url)
    host = (parts.hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if host == "localhost" or address is not None and (address.is_loopback
                                                       or address.is_unspecified):
        host = "loopback"
    elif address is not None:
        host = f"[{address.compressed}]" if address.version == 6 else address.compressed
    return f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def shared_urls(view: FleetView) -> dict[str, list[str]]:
    """Each server (`server_of`) that more than one running engine of reachable nodes
    advertises: the names (`node/engine`) of those engines. Two nodes configured with the
    same loopback URL, or a node that lies: the trainer would reach one server as two members
    (one rank never joins its group, the refit wedges and the real engine is restarted), so
    none of them is a refit member, in the router, or serving until the conflict is gone."""
    claims: dict[str, list[str]] = {}
    for node_id, record in view.nodes.items():
        if record.reachable:
            for engine in record.engines.values():
                if engine.get("url") and engine.get("state") in RUNNING_STATES:
                    claims.setdefault(server_of(engine["url"]), []).append(
                        f"{node_id}/{engine['id']}")
    return {server: names for server, names in claims.items() if len(names) > 1}


def shares_a_server(url: object, shared: dict[str, list[str]]) -> bool:
    """Whether an engine's `url` reaches a server of `shared` (shared_urls)."""
    return bool(shared) and server_of(url) in shared


def refit_members(view: FleetView, book: WeightBook,
                  allowed: set[tuple[str, str]] | None = None,
                  shared: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The engines a refit updates: healthy on reachable nodes, their URL their own
    (`shared_urls`), and, given `allowed`, only those (node, engine). In the order of their
    pages (node id, then engine id); each names its main process (`process`: a trainer's
    cached group is rebuilt for a new one), and carries what `refit.engines` shows of it
    (`pid`, `paused`, `serving`). `shared`: shared_urls(view), when the caller has it."""
    out = []
    shared = shared_urls(view) if shared is None else shared
    for node_id, record in view.nodes.items():
        if not record.reachable:
            continue
        for engine in record.engines.values():
            if engine.get("state") != EngineState.HEALTHY or shares_a_server(
                    engine.get("url"), shared):
                continue
            if allowed is not None and (node_id, engine["id"]) not in allowed:
                continue
            out.append({"node_id": node_id, "id": engine["id"],
                        "incarnation": engine.get("incarnation"), "url": engine.get("url"),
                        "tp_size": engine.get("tp_size"), "process": engine.get("process"),
                        "pid": engine.get("pid"), "paused": engine.get("paused"),
                        "serving": book.serving(node_id, engine),
                        "weight_version": book.version_of(
                            node_id, engine["id"], engine.get("incarnation"),
                            engine.get("process"))})
    return sorted(out, key=member_pages.member_key)


def router_members(view: FleetView, book: WeightBook,
                   shared: dict[str, list[str]] | None = None) -> dict[str, str | None]:
    """What the router must hold: every serving engine of a reachable node, with the version
    it must report before it is added (checked by the router's thread; None before any
    refit)."""
    members: dict[str, str | None] = {}
    shared = shared_urls(view) if shared is None else shared
    for node_id, record in view.nodes.items():
        if not record.reachable:   # its engines may be dead: nobody would tell the router
            continue
        for engine in record.engines.values():
            url = engine.get("url")
            if url and book.serving(node_id, engine) and not shares_a_server(url, shared):
                members[url] = book.version_of(node_id, engine["id"], engine.get("incarnation"))
    return members


RESTORED_WAIT_S = 60.0   # the longest a restarted coordinator waits for a lease's nodes


def restored_due(view: FleetView, members: list[Member], started: float, now: float) -> bool:
    """Whether a lease found on disk at the start can be ended (its members put back, their
    URLs known from their nodes' hellos): every node of `members` is back, or RESTORED_WAIT_S
    passed (a node away longer lifts the refit's pause at its deadline, or when it is back:
    the coordinator's owed resumes). A lease with no member waits for the view as a whole."""
    nodes = {node for node, _, _ in members}
    if not nodes:
        return view.warm(started, now)
    return nodes <= view.nodes.keys() or now - started >= RESTORED_WAIT_S


def _seen(view: FleetView, member: Member) -> dict[str, Any] | None:
    """The view's engine object of this incarnation (None: gone, or another incarnation)."""
    node, engine, incarnation = member
    record = view.nodes.get(node)
    seen = record.engines.get(engine) if record is not None else None
    return seen if seen is not None and seen.get("incarnation") == incarnation else None


def member_urls(view: FleetView, members: list[Member]) -> list[str]:
    """The URLs of those incarnations still in the view (a replaced one is not paused)."""
    return [str(seen["url"]) for seen in (_seen(view, m) for m in members)
            if seen is not None and seen.get("url")]


def gone(view: FleetView, members: list[Member]) -> list[Member]:
    """Those of `members` whose incarnation is no longer running as far as the view knows:
    stopped, dead, relaunched (another incarnation) or removed. Their update is lost."""
    return [m for m in members
            if (seen := _seen(view, m)) is None or seen.get("state") not in RUNNING_STATES]


def paused(view: FleetView, members: list[Member]) -> list[Member]:
    """Those of `members` whose incarnation the view shows with its deep probes paused."""
    return [m for m in members if (seen := _seen(view, m)) is not None and seen.get("paused")]


def deferred_waiting(view: FleetView) -> list[tuple[str, str]]:
    """(node, engine) of each `deferred` engine of a reachable node that waits for a refit to
    be relaunched."""
    return [(node_id, engine["id"]) for node_id in view.reachable()
            for engine in view.nodes[node_id].engines.values()
            if engine.get("deferred_waiting") or (
                engine.get("restart_policy") == "deferred"
                and engine.get("state") == EngineState.BACKOFF)]
