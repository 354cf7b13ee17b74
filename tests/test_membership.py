"""Who a refit updates and what the router holds (refit_bridge/membership.py), asked of a fleet
view built by hand: no process, no socket."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from rollout_watchdog.refit_bridge import membership
from rollout_watchdog.refit_bridge.weights import WeightBook


def view(*nodes: tuple[str, bool, list[dict[str, Any]]]) -> Any:
    return SimpleNamespace(nodes={node: SimpleNamespace(reachable=reachable, engines={
        e["id"]: {"incarnation": 1, "state": "healthy", **e} for e in engines})
        for node, reachable, engines in nodes})


def test_engines_sharing_a_url_are_neither_members_nor_routed_until_it_is_theirs_alone(
        ) -> None:
    """One server reached as two members wedges a refit (one rank never joins): every engine
    whose URL another running engine of a reachable node advertises is left out, of the
    router too. A stopped claimant, or one on an unreachable node, is no conflict."""
    a, b = "http://10.0.0.1:30000", "http://10.0.0.2:30000"
    fleet = view(("n1", True, [{"id": "e0", "url": a}, {"id": "e1", "url": b}]),
                 ("n2", True, [{"id": "x0", "url": a}]))
    book = WeightBook()
    assert membership.shared_urls(fleet) == {a: ["n1/e0", "n2/x0"]}
    assert [m["id"] for m in membership.refit_members(fleet, book)] == ["e1"]
    assert membership.router_members(fleet, book) == {b: None}

    fleet.nodes["n2"].engines["x0"]["state"] = "stopped"
    assert membership.shared_urls(fleet) == {}
    assert [m["id"] for m in membership.refit_members(fleet, book)] == ["e0", "e1"]
    fleet.nodes["n2"].engines["x0"]["state"] = "starting"
    assert membership.shared_urls(fleet) == {a: ["n1/e0", "n2/x0"]}
    fleet.nodes["n2"].reachable = False
    assert membership.router_members(fleet, book) == {a: None, b: None}


def test_the_members_gone_at_a_commit_are_those_the_view_no_longer_runs() -> None:
    fleet = view(("n1", True, [{"id": "e0", "url": "http://h:1"},
                               {"id": "e1", "url": "http://h:2", "incarnation": 2},
                               {"id": "e2", "url": "http://h:3", "state": "backoff"},
                               {"id": "e3", "url": "http://h:4", "state": "suspect"}]))
    members = [("n1", e, 1) for e in ("e0", "e1", "e2", "e3", "e9")]
    assert membership.gone(fleet, members) == [("n1", "e1", 1), ("n1", "e2", 1),
                                               ("n1", "e9", 1)]


def test_urls_that_reach_one_server_are_one_server() -> None:
    """The hostile run's spellings of one engine's URL each slipped past the shared-URL check
    and wedged a refit: a trailing slash, `localhost`, an upper-case scheme."""
    one = {membership.server_of(url) for url in (
        "http://127.0.0.1:30000", "http://127.0.0.1:30000/", "HTTP://127.0.0.1:30000",
        "http://localhost:30000", "http://LocalHost:30000/", "http://[::1]:30000",
        "http://127.0.1.1:30000", "http://0.0.0.0:30000", "http://[::ffff:127.0.0.1]:30000")}
    assert len(one) == 1
    assert membership.server_of("http://h:80") == membership.server_of("http://H/")
    assert membership.server_of("http://[2001:db8:0::1]:5") == membership.server_of(
        "http://[2001:DB8::1]:5")
    assert len({membership.server_of(url) for url in (
        "http://10.0.0.1:30000", "http://10.0.0.2:30000", "http://10.0.0.1:30001",
        "https://10.0.0.1:30000", "http://gw/a", "http://gw/b", "http://[2001:db8::1]:30000",
        "http://[2001:db8::2]:30000")}) == 8
    fleet = view(("n1", True, [{"id": "e0", "url": "http://127.0.0.1:30000"}]),
                 ("n2", True, [{"id": "x0", "url": "http://localhost:30000/"}]))
    assert membership.shared_urls(fleet) == {"http://loopback:30000": ["n1/e0", "n2/x0"]}
