"""One registry for every command (issue 13 §1.4): the node's, the coordinator's queries and its
refit commands declare their arguments, and a malformed one is refused before the handler runs,
by one error that names it (code BAD_ARGS), whichever side and transport it came through."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from daemon_harness import Node, wait_for

from rollout_watchdog.cli.client import ControlError
from rollout_watchdog.common import protocol
from rollout_watchdog.common.commands import (
    Arg,
    ArgumentError,
    Command,
    Registry,
    choice,
    flag,
    integer,
    number,
    rule,
    text,
)
from rollout_watchdog.common.replies import CommandError
from rollout_watchdog.refit_bridge import queries
from rollout_watchdog.refit_bridge import service as refit
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.watchdog import commands as node_commands

REGISTRIES = {"node": node_commands.COMMANDS, "queries": queries.COMMANDS,
              "refit": refit.COMMANDS}
# A value no kind but "anything" takes: not a number, a boolean, a string or a list.
HOSTILE = {"\u202e": [None, 1e308]}


# ---------------------------------------------------------------------- the kinds, one by one


@pytest.mark.parametrize(("kind", "bad", "why"), [
    (number(0), "soon", "must be a finite number >= 0, got 'soon'"),
    (number(0), True, "must be a finite number >= 0"),
    (number(0), -1, "got -1"),
    (number(0), 10**400, "must be a finite number"),
    (number(0, above=True), 0, "must be a finite number > 0, got 0"),
    (number(0, above=True, maximum=60), 61, "> 0 and <= 60, got 61"),
    (integer(1), 2.0, "must be an integer >= 1, got 2.0"),
    (integer(1), False, "must be an integer >= 1"),
    (integer(1), 0, "got 0"),
    (flag, "no", "must be true or false, got 'no'"),
    (flag, 1, "must be true or false, got 1"),
    (text(), "", "must be a non-empty string"),
    (text(), 7, "must be a non-empty string, got 7"),
    (text(4), "12345", "must be a string of 1 to 4 characters"),
    (text(empty=True), 7, "must be a string, got 7"),
    (choice("a", "b"), "c", "must be 'a' or 'b', got 'c'"),
    (rule(lambda v: None if v == 1 else "must be 1"), 2, "must be 1"),
])
def test_each_kind_refuses_a_malformed_value_naming_the_argument(kind: Any, bad: Any,
                                                                 why: str) -> None:
    spec = Command("c", lambda args: args, (Arg("x", kind),))
    with pytest.raises(ArgumentError) as caught:
        spec.validate({"x": bad})
    assert caught.value.argument == "x" and caught.value.code == protocol.BAD_ARGS
    assert str(caught.value).startswith("'x' ") and why in str(caught.value)
    assert len(str(caught.value)) < 300   # one short line, whatever came
    # one error for every transport: the node's (CommandError), the service's (ValueError)
    assert isinstance(caught.value, CommandError) and isinstance(caught.value, ValueError)


def test_validate_converts_fills_defaults_and_passes_undeclared_arguments() -> None:
    spec = Command("c", lambda args: args, (Arg("n", number(0), 5.0), Arg("t", text()),
                                            Arg("need", integer(0), required=True)))
    assert spec.validate({"need": 3, "n": 2, "other": [1]}) == {
        "need": 3, "n": 2.0, "t": None, "other": [1]}
    assert spec.validate({"need": 0, "n": None})["n"] == 5.0   # null is absent
    with pytest.raises(ArgumentError, match=r"^'need' must be an integer >= 0, got None$"):
        spec.validate({})


def test_a_registry_refuses_a_name_twice_and_names_its_commands_for_an_unknown_one() -> None:
    registry: Registry[Callable[..., Any]] = Registry("a test")

    @registry.command("hello", Arg("who", text()))
    def hello(args: dict[str, Any]) -> str:
        """Say hello. args: {"who"}."""
        return f"hello {args['who']}"

    assert registry["hello"].__doc__ == hello.__doc__   # the wire spec and the help text
    assert list(registry) == ["hello"] and "hello" in registry and len(registry) == 1
    with pytest.raises(ValueError, match="registered twice"):
        registry.command("hello")(hello)
    with pytest.raises(CommandError, match=r"unknown command 'bye' \(commands: hello\)") as c:
        registry.lookup("bye")
    assert c.value.code == protocol.UNKNOWN_COMMAND


def declared() -> Iterator[Any]:
    for side, registry in REGISTRIES.items():
        for name, spec in registry.items():
            for arg in spec.args:
                yield pytest.param(spec, arg, id=f"{side}-{name}-{arg.name}")


@pytest.mark.parametrize(("spec", "arg"), list(declared()))
def test_every_declared_argument_of_every_command_refuses_a_hostile_value(
        spec: Command[Any], arg: Arg) -> None:
    if _takes(arg):
        pytest.skip("checked by the lock: a pair that is not the holder's is LEASE_LOST")
    assert arg in spec.args
    with pytest.raises(ArgumentError) as caught:
        arg.take({arg.name: HOSTILE})
    assert caught.value.argument == arg.name
    assert str(caught.value).startswith(f"'{arg.name}' ") and len(str(caught.value)) < 300


def _takes(arg: Arg) -> bool:
    try:
        arg.kind(HOSTILE)
    except ValueError:
        return False
    return True


def test_every_command_has_its_wire_spec_as_docstring() -> None:
    for registry in REGISTRIES.values():
        for name, spec in registry.items():
            assert spec.__doc__ and spec.__doc__.strip(), name
    assert set(refit.COMMANDS) == {"refit_acquire", "refit_members", "refit_renew",
                                   "refit_commit", "refit_abort", "refit_putback",
                                   "refit_release"}
    assert set(queries.COMMANDS) == {"status", "ping", "router_urls"}


# ---------------------------------------------------------------------- through real sockets


@pytest.fixture
def fleet(make_node: Callable[..., Node], coordinator: Coordinator
          ) -> Iterator[tuple[Node, FleetClient]]:
    node = make_node([], node_id="n1", top={"coordinator": coordinator.endpoint}).start()
    client = FleetClient(coordinator.endpoint, timeout_s=20.0)
    wait_for(lambda: client.request(command("ping")).result["reachable"] == 1, 30,
             "the node in the coordinator's view")
    yield node, client
    client.close()


def command(cmd: str, node: str | None = None, **args: Any) -> protocol.Command:
    return protocol.Command(uuid.uuid4().hex, cmd, args, node, None, 10.0)


def test_malformed_arguments_are_refused_by_name_on_the_node_the_queries_and_the_refit(
        fleet: tuple[Node, FleetClient]) -> None:
    node, client = fleet
    # the node, on its local control socket: every kind of argument it declares
    for cmd, args, named in [
            ("pause", {"all": True, "deadline_s": "soon"}, "'deadline_s' must be a finite number"),
            ("pause", {"all": True, "deadline_s": 86401}, "'deadline_s' must be a finite number"),
            ("pause", {"all": "no"}, "'all' must be true or false"),
            ("pause", {"all": True, "owner": "o" * 101}, "'owner' must be a string of 1 to 100"),
            ("events", {"since": -1}, "'since' must be a finite number >= 0"),
            ("restart", {"engine": 5}, "'engine' must name an engine"),
            ("restart", {"engine": "e0", "cause": "boredom"}, "'cause' must be 'refit_wedged'"),
            ("register", {"engine": "x", "url": "http://127.0.0.1:1", "pid": "1"},
             "'pid' must be an integer >= 1, got '1'"),
            ("register", {"engine": "x", "url": "gopher", "pid": 1}, "'url' must be an http"),
            ("register", {"engine": "../x", "url": "http://127.0.0.1:1", "pid": 1},
             "'engine' must be a string of at most 64")]:
        with pytest.raises(ControlError) as refused:
            node.client.call(cmd, args)
        assert named in str(refused.value), (cmd, args)
    # the node, through the coordinator: its answer carries the code
    fanned = client.request(command("pause", node="n1", all=True, owner=7))
    assert fanned.status == "error" and fanned.code == protocol.NODE_ERRORS
    answer = fanned.result["nodes"]["n1"]
    assert answer["code"] == protocol.BAD_ARGS
    assert answer["reason"] == "'owner' must be a string of 1 to 100 characters, got 7"
    # a query
    page = client.request(command("status", after=5))
    assert (page.status, page.code) == ("error", protocol.BAD_ARGS)
    assert page.reason == "'after' must be a non-empty string, got 5"
    # the refit commands: before the lock, and with it
    for args, named in [({"holder": "", "version": "v1"}, "'holder' must be a non-empty"),
                        ({"holder": "a", "version": "v\n"}, "'version' must be printable"),
                        ({"holder": "a", "version": "v1", "lease_s": "long"},
                         "'lease_s' must be a finite number > 0, got 'long'"),
                        ({"holder": "a", "version": "v1", "deadline_s": -1},
                         "'deadline_s' must be a finite number > 0")]:
        refused_acquire = client.request(command("refit_acquire", **args))
        assert (refused_acquire.status, refused_acquire.code) == ("error", protocol.BAD_ARGS)
        assert str(refused_acquire.reason).startswith(named), refused_acquire.reason
    taken = client.request(command("refit_acquire", holder="a", version="v1"))
    assert taken.status == "ok", taken.reason
    fence = {"holder": "a", "token": taken.result["token"]}
    for cmd, args, named in [
            ("refit_commit", {"version": "v1", "members": "all"},
             "'members' must be a list of [node, engine, incarnation]"),
            ("refit_commit", {"version": "v1", "members": [], "release": "yes"},
             "'release' must be true or false"),
            ("refit_abort", {"wedged": [["n1", "e0", "1"]]}, "'wedged' holds ['n1', 'e0', '1']"),
            ("refit_abort", {"reason": 7}, "'reason' must be a string")]:
        bad = client.request(command(cmd, **fence, **args))
        assert (bad.status, bad.code) == ("error", protocol.BAD_ARGS), (cmd, bad)
        assert str(bad.reason).startswith(named), bad.reason
    # nothing was done by a refused call: the lock is still the holder's, then released
    assert client.request(command("refit_renew", **fence)).status == "ok"
    stale = client.request(command("refit_renew", holder="a", token="not-it"))
    assert stale.code == protocol.LEASE_LOST   # the fence is the lock's to check
    released = client.request(command("refit_commit", **fence, version="v1", members=[],
                                      release=True))
    assert released.status == "ok" and released.result["released"] == fence["token"]
