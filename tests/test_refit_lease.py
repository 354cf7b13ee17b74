"""The refit lock against a hostile run (issue 13, section 3): fencing tokens across coordinator
restarts, pause ownership under back-to-back refits with crashes, a trainer that dies or stalls
mid-refit, and the bound on a version string. Real processes throughout."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import pytest
import requests
from daemon_harness import Node, run_command, wait_for
from fleet_harness import CoordinatorConnection, CoordinatorProcess, start_coordinator_process
from refit_harness import TRAINER, all_healthy, by_name, generate, start_fleet, weights
from test_daemon_logic import healthy, make_daemon

from rollout_watchdog import CoordinatorUnavailable, EngineLost, FleetClient, LeaseLost
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.lock_holder import LockHolder

# ---------------------------------------------------------------------- fencing tokens


def reply_of(conn: CoordinatorConnection, cmd: str, **args: Any) -> Any:
    return conn.call(cmd, args, timeout_s=15.0)


def ok(conn: CoordinatorConnection, cmd: str, **args: Any) -> dict[str, Any]:
    reply = reply_of(conn, cmd, **args)
    assert reply.status == "ok", f"{cmd}: {reply.reason}"
    return dict(reply.result)


@pytest.fixture
def restartable(tmp_path: Path) -> Iterator[Callable[..., CoordinatorProcess]]:
    """start(*args): a coordinator process on one fixed port, started again after a kill."""
    bind = f"tcp://127.0.0.1:{free_port()}"
    started: list[CoordinatorProcess] = []

    def start(*args: str) -> CoordinatorProcess:
        started.append(start_coordinator_process(bind, args, log_path=tmp_path / "coord.log",
                                                 ready_timeout_s=30.0))
        return started[-1]

    yield start
    for coord in started:
        coord.cleanup()


def fenced_after_a_restart(start: Callable[..., CoordinatorProcess],
                           between: Callable[[], object], *args: str) -> None:
    """Trainer A takes the lock, the coordinator is SIGKILLed and started again, trainer B takes
    the lock and commits vB (keeping it); A's late commit with its old token (members [],
    version vA-STALE) is refused, and the fleet's version and B's lock are untouched."""
    coord = start(*args)
    a, b = coord.connect(), None
    try:
        taken = ok(a, "refit_acquire", holder="trainer-a", version="vA", lease_s=600)
        coord.kill()
        between()
        coord = start(*args)
        b = coord.connect()
        mine = ok(b, "refit_acquire", holder="trainer-b", version="vB", lease_s=600)
        assert mine["token"] != taken["token"]
        ok(b, "refit_commit", holder="trainer-b", token=mine["token"], version="vB", members=[])
        for holder in ("trainer-a", "trainer-b"):   # neither its own name nor B's helps A
            late = reply_of(a, "refit_commit", holder=holder, token=taken["token"],
                            version="vA-STALE", members=[], release=True)
            assert late.status == "error" and str(late.reason).startswith("lease lost"), late
            assert mine["token"] not in json.dumps([late.reason, late.result])
        refit = ok(a, "ping")["refit"]
        assert refit["current_version"] == "vB"
        assert refit["holder"]["holder"] == "trainer-b"
        assert mine["token"] not in json.dumps(refit)   # ping never shows the token
        held = reply_of(a, "refit_acquire", holder="trainer-a", version="vA")
        assert held.status == "error" and held.result["holder"] == "trainer-b"
        assert mine["token"] not in json.dumps([held.reason, held.result])
        ok(b, "refit_renew", holder="trainer-b", token=mine["token"])
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_restarted_coordinator_without_a_state_dir_never_hands_out_a_token_again(
        restartable: Callable[..., CoordinatorProcess]) -> None:
    fenced_after_a_restart(restartable, lambda: None)


def test_a_state_file_moved_away_does_not_hand_out_a_token_again(
        restartable: Callable[..., CoordinatorProcess], tmp_path: Path) -> None:
    state = tmp_path / "state"
    fenced_after_a_restart(restartable, lambda: (state / "refit.json").rename(
        tmp_path / "refit.json.old"), "--state-dir", str(state))


def test_an_old_state_file_still_loads_and_counts_on(
        restartable: Callable[..., CoordinatorProcess], tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "refit.json").write_text(json.dumps({
        "next_token": 41, "weights": {"current": "v7", "held": [["n", "e0", 2, "v7"]]},
        "in_flight": []}))
    coord = restartable("--state-dir", str(state))
    conn = coord.connect()
    try:
        assert ok(conn, "ping")["refit"]["current_version"] == "v7"
        taken = ok(conn, "refit_acquire", holder="a", version="v8")
        assert taken["token"].split("-")[1] == "41"
        assert json.loads((state / "refit.json").read_text())["next_token"] == 42
    finally:
        conn.close()


# ---------------------------------------------------------------------- the version bound


def test_a_version_is_at_most_256_printable_characters(
        restartable: Callable[..., CoordinatorProcess]) -> None:
    fleet = FleetClient("tcp://127.0.0.1:1")   # refused before any call
    for bad, why in (("v" * 257, "at most 256"), ("v1\n", "printable"), ("", "non-empty")):
        with pytest.raises(ValueError, match=why):
            fleet.refit(bad)
    fleet.refit("v" * 256)   # the longest (entering it would call the coordinator)
    coord = restartable()
    conn = coord.connect()
    try:
        refused = reply_of(conn, "refit_acquire", holder="a", version="v" * 600_000)
        assert refused.status == "error" and "at most 256 characters" in str(refused.reason)
        assert ok(conn, "ping")["refit"]["holder"] is None   # the lock stays free
        taken = ok(conn, "refit_acquire", holder="a", version="v1")
        long = reply_of(conn, "refit_commit", holder="a", token=taken["token"],
                        version="v\x00", members=[])
        assert long.status == "error" and "printable" in str(long.reason)
        assert ok(conn, "ping")["refit"]["current_version"] is None
    finally:
        conn.close()


# ---------------------------------------------------------------------- pause ownership


def test_a_resume_by_an_owner_lifts_its_own_pause_only(tmp_path: Path) -> None:
    """finish_generation's untagged pause and a refit's tagged one: the refit's resume leaves
    the engine paused; the untagged resume (prepare_for_generation) lifts everything, and a
    tagged resume of a pause adopted after a restart (no owners known) lifts it."""
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    run_command(daemon, "pause", engine="e0", deadline_s=600.0, wait_s=0.0).poll()
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0, owner="r1").poll()
    run_command(daemon, "resume", engine="e0", owner="r1")
    assert engine.paused is not None and set(engine.paused.owners) == {""}
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0, owner="r2").poll()
    run_command(daemon, "resume", engine="e0", owner="r1")   # late: r1's pause is gone
    assert engine.paused is not None and set(engine.paused.owners) == {"", "r2"}
    run_command(daemon, "resume", engine="e0", keep="r2")    # untagged, while r2 refits
    assert engine.paused is not None and set(engine.paused.owners) == {"r2"}
    run_command(daemon, "resume", engine="e0", keep="r9")    # (r9's refit paused nothing)
    assert engine.paused is None
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0, owner="r2").poll()
    run_command(daemon, "resume", engine="e0")
    assert engine.paused is None
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0, owner="r3").poll()
    assert engine.paused is not None
    engine.paused.owners = {}   # as adoption.py rebuilds it
    run_command(daemon, "resume", engine="e0", owner="r3")
    assert engine.paused is None


def test_an_orphaned_refit_pause_lapses_at_its_own_deadline_not_a_later_refits(
        tmp_path: Path) -> None:
    """A refit whose holder died (no coordinator left to resume it) paused for 60 s; every
    later refit's pause (600 s) extended the whole pause, and its resume lifted its own part
    only, so the orphan's part lasted as long as refits kept coming (the hostile run). Now
    each owner's part keeps its own deadline: once r2 resumes, the pause ends with r1's."""
    daemon = make_daemon(tmp_path)
    engine = healthy(daemon)
    run_command(daemon, "pause", engine="e0", deadline_s=60.0, wait_s=0.0, owner="r1").poll()
    assert engine.paused is not None
    orphan = engine.paused.expires
    run_command(daemon, "pause", engine="e0", deadline_s=600.0, wait_s=0.0, owner="r2").poll()
    assert engine.paused.expires > orphan + 500   # extended while r2 refits
    run_command(daemon, "resume", engine="e0", owner="r2")
    assert engine.paused is not None and set(engine.paused.owners) == {"r1"}
    assert engine.paused.expires == orphan


SOAK_REFITS = int(os.environ.get("RW_SOAK_REFITS", "50"))


def test_back_to_back_refits_with_crashes_leave_no_engine_paused(
        make_node: Callable[..., Node], coordinator: Coordinator) -> None:
    """RW_SOAK_REFITS (default 50: about 20 s here; set more for a deeper soak) refits back to
    back, the retry loop of docs/refit.md, a healthy engine SIGKILLed before every third one
    while two are healthy. Each acquisition follows the last release at once, while the view
    may still show its pause. Afterwards no
    engine stays paused (a pause left behind lasts until its deadline, 120 s here), and every
    engine serves the last version after one more refit."""
    fleet = FleetClient(coordinator.endpoint)
    start_fleet(make_node, coordinator.endpoint, nodes=2, engines=2,
                restart={"max_restarts": 1000})   # a soak's crashes are not a crash loop
    fleet.wait_until(all_healthy(4), 90)
    rng = random.Random(13)
    committed = kills = 0
    for i in range(SOAK_REFITS):
        healthy_now = [e for e in fleet.engines() if e.state == "healthy" and e.pid]
        if i % 3 == 2 and len(healthy_now) >= 2:   # a refit always has a member
            os.kill(int(rng.choice(healthy_now).pid or 0), signal.SIGKILL)
            kills += 1
        try:
            with fleet.refit(f"soak-{i}", backend="gloo", timeout_s=60) as refit:
                refit.update_weights(weights(i))
            committed += 1
        except (EngineLost, LeaseLost):
            continue
    print(f"{SOAK_REFITS} refits: {committed} committed, {kills} engine(s) SIGKILLed")
    # (an engine is back in seconds, a refit takes a fraction of one: kills wait for victims)
    assert committed >= SOAK_REFITS // 2 and kills >= min(3, SOAK_REFITS // 3), (committed, kills)
    fleet.wait_until(lambda view: not any(e.paused for e in view), 30)
    fleet.wait_until(all_healthy(4), 90)
    with fleet.refit("soak-last", backend="gloo", timeout_s=60) as refit:
        refit.update_weights(weights(99))
    fleet.wait_until(lambda view: not any(e.paused for e in view), 30)
    assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("soak-last", True)}


# ---------------------------------------------------------------------- a trainer gone mid-refit


def generating(url: str) -> bool:
    return generate(url)[0] == 200


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_trainer_gone_mid_refit_gets_no_engine_restarted(
        make_node: Callable[..., Node], how: signal.Signals) -> None:
    """The trainer paused generation, opened the update sessions and broadcast a tensor, then
    died (or stalled). When its lease ends the coordinator ends the sessions, continues
    generation and marks the members stale before probes resume: no engine is restarted, and
    each generates again (out of the router: stale). The next refit, with probes running all
    along, still finds the same incarnations."""
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     holder_timeout_s=3.0) as coordinator:
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        before = {e.name: (e.incarnation, e.restarts) for e in fleet.engines()}
        trainer = subprocess.Popen([sys.executable, str(TRAINER), coordinator.endpoint, "v1",
                                    "1", "--stall", "--timeout-s", "120"],
                                   stdout=subprocess.PIPE, text=True)
        try:
            assert trainer.stdout is not None
            assert json.loads(trainer.stdout.readline())["paused"]
            urls = [str(e.url) for e in fleet.engines()]
            assert {generate(url, timeout=1.0)[0] for url in urls} == {None}   # paused
            os.kill(trainer.pid, how)
            fleet.wait_until(lambda view: all(e.weight_version is None and not e.serving
                                              and not e.paused for e in view), 60)
            for url in urls:   # (a relaunched one would too: the incarnations tell)
                wait_for(partial(generating, url), 30, f"{url} generating")
            assert {e.name: (e.incarnation, e.restarts) for e in fleet.engines()} == before
        finally:
            if how == signal.SIGSTOP:
                os.kill(trainer.pid, signal.SIGCONT)
            trainer.kill()
            trainer.wait(10)
        # The next refit takes them all and they serve again.
        with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:
            refit.update_weights(weights(2))
        assert {(e.weight_version, e.serving) for e in by_name(fleet).values()} \
            == {("v2", True)}
        assert {e.name: (e.incarnation, e.restarts) for e in fleet.engines()} == before


# ---------------------------------------------------------------------- late and dying commits


@contextlib.contextmanager
def one_node_of_two(make_node: Callable[..., Node], holder_timeout_s: float
                    ) -> Iterator[tuple[Coordinator, FleetClient, list[str]]]:
    """An embedded coordinator, one node of two healthy engines: (it, a client, their URLs)."""
    with Coordinator(bind="tcp://127.0.0.1:0", node_timeout_s=3.0,
                     holder_timeout_s=holder_timeout_s) as coordinator:
        fleet = FleetClient(coordinator.endpoint)
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        yield coordinator, fleet, [str(e.url) for e in fleet.engines()]


def trainer_process(endpoint: str, version: str, seed: int, *flags: str
                    ) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(TRAINER), endpoint, version, str(seed),
                             "--timeout-s", "120", *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def line_of(trainer: subprocess.Popen[str]) -> dict[str, Any]:
    assert trainer.stdout is not None
    line = trainer.stdout.readline()
    assert line, f"the trainer ended (status {trainer.poll()}) without a line"
    return dict(json.loads(line))


def test_a_holder_stopped_past_its_lease_leaves_the_next_holders_members_alone(
        make_node: Callable[..., Node]) -> None:
    """Trainer A's update went out whole; A is SIGSTOPped just before its commit until its
    lease ends, and trainer B takes the lock and stalls mid-broadcast, its members' generation
    paused and their update sessions open. A goes on: it gets LeaseLost, and B's members are
    still paused (A neither ended their sessions nor continued their generation: the hostile
    run saw B's engines generate with half-updated weights, and B's refit fail)."""
    with one_node_of_two(make_node, holder_timeout_s=2.0) as (coordinator, fleet, urls):
        a = trainer_process(coordinator.endpoint, "vA", 1, "--gate-commit")
        b = None
        try:
            assert line_of(a)["updated"]
            os.kill(a.pid, signal.SIGSTOP)
            b = trainer_process(coordinator.endpoint, "vB", 2, "--stall")
            assert line_of(b)["paused"]   # (it waited while A's lease ran out)
            assert {generate(url, timeout=1.0)[0] for url in urls} == {None}
            os.kill(a.pid, signal.SIGCONT)
            the_stale_holder_leaves_b_alone(a, fleet, urls)
        finally:
            for trainer in (a, b):
                if trainer is not None and trainer.poll() is None:
                    os.kill(trainer.pid, signal.SIGCONT)
                    trainer.kill()
                    trainer.wait(10)


def test_a_trainer_dead_before_its_commit_leaves_no_engine_generating_its_weights(
        make_node: Callable[..., Node]) -> None:
    """The trainer SIGKILLs itself just before it sends refit_commit: the members hold its
    version, read back, and their generation is still paused (it is continued after the
    commit is recorded: the hostile run saw the router serve the uncommitted version for the
    5 s until the lease ended). When the lease ends the coordinator puts them back, stale;
    the next refit serves again."""
    with one_node_of_two(make_node, holder_timeout_s=5.0) as (coordinator, fleet, urls):
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--die-before",
                                  "refit_commit")
        assert trainer.wait(60) == -signal.SIGKILL
        assert {generate(url, timeout=1.0)[0] for url in urls} == {None}, \
            "generation continued before the commit was recorded"
        fleet.wait_until(lambda view: all(e.weight_version is None and not e.serving
                                          and not e.paused for e in view), 60)
        for url in urls:
            wait_for(partial(generating, url), 30, f"{url} generating")
        with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:
            refit.update_weights(weights(2))
        assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("v2", True)}


def test_a_trainer_dead_right_after_its_commit_leaves_no_engine_paused(
        make_node: Callable[..., Node]) -> None:
    """The trainer SIGKILLs itself once its commit is recorded, before it continues the
    members' generation and releases the lock: when its lease ends the coordinator continues
    their generation (they hold the committed version) and they serve it, not stale."""
    with one_node_of_two(make_node, holder_timeout_s=3.0) as (coordinator, fleet, urls):
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--die-after",
                                  "refit_commit")
        assert trainer.wait(60) == -signal.SIGKILL
        for url in urls:
            wait_for(partial(generating, url), 30, f"{url} generating")
        fleet.wait_until(lambda view: {(e.weight_version, e.serving, e.paused)
                                       for e in view} == {("v1", True, False)}, 30)
        assert fleet.call("ping")[1]["refit"]["holder"] is None


def test_a_holder_whose_coordinator_restarted_never_continues_the_next_holders_members(
        make_node: Callable[..., Node], restartable: Callable[..., CoordinatorProcess]) -> None:
    """Trainer A's coordinator restarted without a state dir just before A's commit. A's
    abort (its lease lost) asked whether anyone held the lock (`ping`), then continued its
    members itself: trainer B, which took the lock between the two, had its paused members
    continued mid-update (the hostile run). Now A asks the coordinator to put them back
    (`refit_putback`), which checks and begins it in one step: B takes the lock once it
    ended, and B's members stay paused whatever A does next."""
    coordinator = restartable("--node-timeout", "3")
    fleet = FleetClient(coordinator.endpoint)
    a = b = None
    try:
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        urls = [str(e.url) for e in fleet.engines()]
        a = trainer_process(coordinator.endpoint, "vA", 1, "--gate-commit",
                            "--hold-after", "ping,refit_putback")
        assert line_of(a)["updated"]
        coordinator.kill()
        restartable("--node-timeout", "3")
        fleet.wait_until(all_healthy(2), 60)   # (the node is back)
        go(a)
        assert line_of(a)["held_after"] in {"ping", "refit_putback"}   # A has asked
        for url in urls:   # (put back by the coordinator, as A asked)
            wait_for(partial(generating, url), 30, f"{url} put back in service")
        fleet.wait_until(lambda view: not any(e.paused for e in view), 30)   # A's pause lifted
        b = trainer_process(coordinator.endpoint, "vB", 2, "--stall")
        assert line_of(b)["paused"]
        the_stale_holder_leaves_b_alone(a, fleet, urls)
    finally:
        for trainer in (a, b):
            if trainer is not None:
                trainer.kill()
                trainer.wait(10)
        fleet.close()


def test_a_member_relaunched_between_its_read_back_and_the_commit_is_lost_not_committed(
        make_node: Callable[..., Node]) -> None:
    """The trainer read every member's version back, then stopped (SIGSTOP) just before its
    commit; meanwhile one member was SIGKILLed and relaunched with the weights from disk. On
    going on, its commit was accepted whole and `refit()` reported that member committed (the
    hostile run; the view was right: the new incarnation was not serving). Now the commit
    answers it `gone`, and `refit()` raises EngineLost naming it: the others committed."""
    with one_node_of_two(make_node, holder_timeout_s=300.0) as (coordinator, fleet, urls):
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--stop-before",
                                  "refit_commit", "--lease-s", "300")
        try:
            wait_for(lambda: psutil.Process(trainer.pid).status() == psutil.STATUS_STOPPED, 60,
                     "the trainer stopped before its commit")
            victim = by_name(fleet)["node0/e0"]
            engine = psutil.Process(victim.pid or 0)
            for process in [*engine.children(recursive=True), engine]:
                process.kill()
            fleet.wait_until(lambda view: any(e.name == "node0/e0" and e.incarnation == 2
                                              for e in view), 60)
            os.kill(trainer.pid, signal.SIGCONT)
            outcome = line_of(trainer)
        finally:
            os.kill(trainer.pid, signal.SIGCONT)
            trainer.kill()
            trainer.wait(10)
        assert outcome.get("error") == "EngineLost", outcome
        assert outcome["lost"] == [["node0", "e0", 1]], outcome
        fleet.wait_until(lambda view: {(e.name, e.weight_version, e.serving) for e in view} ==
                         {("node0/e0", None, False), ("node0/e1", "v1", True)}, 30)


def the_stale_holder_leaves_b_alone(a: subprocess.Popen[str], fleet: FleetClient,
                                    urls: list[str]) -> None:
    """Trainer A, whose lease was lost, goes on while B holds the lock with its members
    paused: A gets LeaseLost, B still holds the lock and its members are still paused."""
    go(a)
    outcome = line_of(a)
    assert outcome["error"] == "LeaseLost", outcome
    assert a.wait(30) == 1
    assert {generate(url, timeout=1.0)[0] for url in urls} == {None}, \
        "the stale holder continued the next holder's members"
    holder = fleet.call("ping")[1]["refit"]["holder"]
    assert holder is not None and holder["version"] == "vB", holder


def go(trainer: subprocess.Popen[str]) -> None:
    """Let a trainer waiting on its stdin (--gate-commit, --hold-after) go on."""
    assert trainer.stdin is not None
    trainer.stdin.write("go\n")
    trainer.stdin.flush()


def test_a_commit_without_an_answer_leaves_no_member_paused(
        make_node: Callable[..., Node], monkeypatch: pytest.MonkeyPatch) -> None:
    """The commit is sent while generation is paused; when it gets no answer
    (CoordinatorUnavailable), the abort continues the members (a review of the new order
    found them left paused until the next refit: the phase no longer said so)."""
    call = LockHolder.call

    def unanswered(holder: LockHolder, cmd: str, *rest: Any, **kwargs: Any) -> dict[str, Any]:
        if cmd == "refit_commit":
            raise CoordinatorUnavailable("no answer to refit_commit (injected)")
        return call(holder, cmd, *rest, **kwargs)

    with one_node_of_two(make_node, holder_timeout_s=5.0) as (_, fleet, urls):
        before = {e.name: (e.incarnation, e.restarts) for e in fleet.engines()}
        monkeypatch.setattr(LockHolder, "call", unanswered)
        with pytest.raises(CoordinatorUnavailable), \
                fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
            refit.update_weights(weights(1))
        for url in urls:   # at once, not after its watchdog relaunched it for failed probes
            assert generate(url, timeout=5.0)[0] == 200, f"{url} left paused"
        assert {e.name: (e.incarnation, e.restarts) for e in fleet.engines()} == before


def test_an_update_session_left_open_by_a_holder_that_lost_its_lease_is_ended(
        make_node: Callable[..., Node]) -> None:
    """A trainer that lost its lease mid-update (its coordinator restarted without a state
    dir) left its members' update sessions open, and the next refit failed with UpdateRefused
    ("a session already open"), which the documented loop does not retry (the hostile run).
    Now a new group ends any session its members had open before it begins its own."""
    with one_node_of_two(make_node, holder_timeout_s=3.0) as (_, fleet, urls):
        for url in urls:
            requests.post(f"{url}/begin_weight_update", json={}, timeout=10).raise_for_status()
        with fleet.refit("v1", backend="gloo", timeout_s=60) as refit:
            refit.update_weights(weights(1))
        assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("v1", True)}


def test_prepare_for_generation_from_another_thread_leaves_a_refits_pause(
        make_node: Callable[..., Node]) -> None:
    """Another thread of the trainer calls prepare_for_generation() (an ownerless resume)
    while a refit has its members' generation paused: it lifted the refit's probe pause too,
    and the probes then failed the paused engines and killed them (the hostile run: EngineLost
    on both members). Now the refit's own pause stays until its release."""
    with one_node_of_two(make_node, holder_timeout_s=5.0) as (coordinator, fleet, urls):
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--gate-commit")
        try:
            assert line_of(trainer)["updated"]
            fleet.prepare_for_generation()
            assert all(e.paused for e in fleet.engines()), "the refit's pause was lifted"
            assert trainer.stdin is not None
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            assert line_of(trainer).get("ok"), "the refit did not commit"
        finally:
            trainer.kill()
            trainer.wait(10)
        fleet.wait_until(lambda view: {(e.weight_version, e.serving, e.paused)
                                       for e in view} == {("v1", True, False)}, 30)


def test_a_node_unreachable_at_the_release_gets_the_refits_resume_when_it_is_back(
        make_node: Callable[..., Node]) -> None:
    """The node daemon SIGSTOPped past the node timeout while the refit commits and releases:
    the release's resume reached only reachable nodes, so once continued the node kept the
    refit's probe pause until its deadline (timeout_s + 60 s; the hostile run). Now the
    resume is sent again as soon as the node is reachable."""
    with one_node_of_two(make_node, holder_timeout_s=5.0) as (coordinator, fleet, urls):
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--gate-commit")
        parent = psutil.Process(fleet.engines()[0].pid or 0).parent()
        assert parent is not None and "run" in parent.cmdline(), "not the node daemon"
        pid = parent.pid
        try:
            assert line_of(trainer)["updated"]
            os.kill(pid, signal.SIGSTOP)
            wait_for(lambda: not fleet.nodes()[0].reachable, 30, "the node unreachable")
            assert trainer.stdin is not None
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            assert line_of(trainer).get("ok"), "the refit did not commit"
        finally:
            os.kill(pid, signal.SIGCONT)
            trainer.kill()
            trainer.wait(10)
        fleet.wait_until(lambda view: {(e.weight_version, e.paused) for e in view}
                         == {("v1", False)}, 30)


# ---------------------------------------------------------------------- coordinator restarts


@pytest.mark.parametrize("step", ["gated", "committed"])
def test_a_coordinator_killed_with_its_trainer_mid_refit_puts_the_members_back(
        make_node: Callable[..., Node], restartable: Callable[..., CoordinatorProcess],
        tmp_path: Path, step: str) -> None:
    """The coordinator (with a state dir) and the trainer SIGKILLed together (the driver's
    host died) mid-refit: `gated`, updated and paused before its commit; `committed`, once
    its commit is recorded, before it continued generation. The restarted coordinator knew
    only that the members were stale: their generation stayed paused and their update
    sessions open, the refit's probe pause was never lifted, and the next refit failed
    (`UpdateRefused`: a session open). Now it ends that lease as its expiry would, once its
    nodes are back: sessions ended, generation continued (`committed`: they serve the
    version), the pause lifted; the next refit commits."""
    state = str(tmp_path / "state")
    coordinator = restartable("--node-timeout", "3", "--state-dir", state)
    endpoint = coordinator.endpoint
    fleet = FleetClient(endpoint)
    try:
        start_fleet(make_node, endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        urls = [str(e.url) for e in fleet.engines()]
        flags = ["--gate-commit"] if step == "gated" else ["--die-after", "refit_commit"]
        trainer = trainer_process(endpoint, "v1", 1, *flags)
        if step == "gated":
            assert line_of(trainer)["updated"]
        else:
            assert trainer.wait(60) == -signal.SIGKILL
        coordinator.kill()
        trainer.kill()
        trainer.wait(10)
        assert {generate(url, timeout=1.0)[0] for url in urls} == {None}   # paused
        restartable("--node-timeout", "3", "--state-dir", state)
        for url in urls:
            wait_for(partial(generating, url), 60, f"{url} generating")
        expected = ("v1", True) if step == "committed" else (None, False)
        fleet.wait_until(lambda view: {(e.weight_version, e.serving, e.paused)
                                       for e in view} == {(*expected, False)}, 60)
        assert fleet.call("ping")[1]["refit"]["holder"] is None
        with fleet.refit("v2", backend="gloo", timeout_s=60) as refit:
            refit.update_weights(weights(2))
        assert {(e.weight_version, e.serving) for e in fleet.engines()} == {("v2", True)}
    finally:
        fleet.close()


def test_a_coordinator_killed_during_a_put_back_puts_the_members_back_after_its_restart(
        make_node: Callable[..., Node], restartable: Callable[..., CoordinatorProcess],
        tmp_path: Path) -> None:
    """The trainer SIGKILLed mid-refit, its lease ended (holder silent), and the coordinator
    (with a state dir) SIGKILLed while it put the members back: one member's put-back hung
    (its server SIGSTOPped). The state written at the lease's end did not name the lease
    being put back, so the restarted coordinator left that member paused until its watchdog
    killed it. Now the state keeps that lease until its put-back ended: the restarted
    coordinator puts the member back, and no engine is restarted."""
    state = str(tmp_path / "state")
    args = ("--node-timeout", "3", "--holder-timeout", "2", "--state-dir", state)
    coordinator = restartable(*args)
    fleet = FleetClient(coordinator.endpoint)
    hung = None
    try:
        start_fleet(make_node, coordinator.endpoint, nodes=1, engines=2)
        fleet.wait_until(all_healthy(2), 90)
        before = {e.name: e.incarnation for e in fleet.engines()}
        urls = [str(e.url) for e in fleet.engines()]
        trainer = trainer_process(coordinator.endpoint, "v1", 1, "--gate-commit")
        assert line_of(trainer)["updated"]
        hung = fleet.engines()[0].pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)
        trainer.kill()
        trainer.wait(10)
        wait_for(lambda: (fleet.call("ping")[1]["refit"]["holder"] or {}).get("holder")
                 == "coordinator", 30, "the coordinator putting the members back")
        coordinator.kill()
        os.kill(hung, signal.SIGCONT)
        hung = None
        assert generate(urls[0], timeout=1.0)[0] is None   # still paused
        restartable(*args)
        for url in urls:
            wait_for(partial(generating, url), 60, f"{url} generating")
        fleet.wait_until(lambda view: {(e.weight_version, e.serving, e.paused)
                                       for e in view} == {(None, False, False)}, 60)
        assert {e.name: e.incarnation for e in fleet.engines()} == before
    finally:
        if hung is not None:
            os.kill(hung, signal.SIGCONT)
        fleet.close()
