"""Thread control over a pipe (agent/pipe.py): the embedded coordinator's hub and the refit's
guard thread sleep until their next deadline, and a command down the pipe (stop, reload the
keys, renew the lease) wakes them at once. Each test puts every timer of the thread an hour
away, so that only the pipe can wake it in time: were it polling a flag, or waiting out its
timer, the thread would still be asleep at the test's deadline."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import zmq
from daemon_harness import wait_for
from test_coordinator import Peer, curve_of, keys  # noqa: F401

from rollout_watchdog.agent.pipe import STOP, Pipe
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.refit_state import RefitGuard
from rollout_watchdog.refit_bridge.refit_watch import RefitWatch

AN_HOUR = 3600.0
DEADLINE_S = 30.0     # generous (a shared, loaded machine), and far below AN_HOUR


def asleep_for_an_hour(key_dir: str | None = None) -> Coordinator:
    """An embedded coordinator whose loop has nothing due for an hour: heartbeats and the
    sweep (its only timers besides gatherings and the refit lock, both idle here)."""
    coordinator = Coordinator(bind="tcp://127.0.0.1:0", keys=key_dir, heartbeat_s=AN_HOUR)
    coordinator.hub.sweep_s = AN_HOUR
    return coordinator


def alive(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name and t.is_alive()]


def test_stop_wakes_an_embedded_coordinator_asleep_in_its_poll() -> None:
    coordinator = asleep_for_an_hour()
    coordinator.start()
    try:
        client = FleetClient(coordinator.endpoint, timeout_s=DEADLINE_S)
        assert client.call("ping")[1]["nodes"] == 0   # serving; then back asleep in its poll
    finally:
        coordinator.stop(timeout_s=DEADLINE_S)
    assert alive("rollout-watchdog-coordinator") == []
    assert coordinator.hub.sock is None               # the loop ended and closed the hub
    again = Coordinator(bind=coordinator.endpoint)    # its port is free again
    again.start()
    again.stop()


def test_reload_keys_wakes_an_embedded_coordinator_at_once(tmp_path: Path,
                                                           keys: Path) -> None:  # noqa: F811
    """A key added to authorized/ lets its client in once reload_keys() is called, although
    the coordinator's loop has nothing due for an hour."""
    coordinator = asleep_for_an_hour(str(keys))
    coordinator.start()
    late = Peer(coordinator.endpoint, curve_of(tmp_path, "stranger"))
    try:
        assert late.call("ping", timeout=1.0) is None          # not on the list yet
        (keys / "authorized" / "stranger.key").write_bytes(
            (tmp_path / "peers" / "stranger.key").read_bytes())
        coordinator.reload_keys()

        def let_in() -> object:
            nonlocal late   # a new connection each try: libzmq does not retry a refused one
            late.close()
            late = Peer(coordinator.endpoint, curve_of(tmp_path, "stranger"))
            return late.call("ping", timeout=2.0)   # (a handshake on a loaded host)
        wait_for(let_in, DEADLINE_S, "the reloaded key let in")
    finally:
        late.close()
        coordinator.stop(timeout_s=DEADLINE_S)
    assert alive("rollout-watchdog-coordinator") == []


def guard(client: FleetClient, renewed: threading.Event) -> RefitWatch:
    """A refit's guard thread, its deadline an hour away, that records its renewals."""
    return RefitWatch(client, "v1", RefitGuard(), time.monotonic() + AN_HOUR, AN_HOUR,
                      renewed.set, lambda group, why: None)


def test_stop_wakes_the_refit_guard_at_once() -> None:
    """The guard follows the fleet's events with no timer due before its deadline (an hour):
    stop() ends it at once."""
    with Coordinator(bind="tcp://127.0.0.1:0") as coordinator:
        watch = guard(FleetClient(coordinator.endpoint), threading.Event())
        watch.start()
        assert alive("rollout-watchdog-refit-guard") != []
        watch.stop(wait=True)
        assert alive("rollout-watchdog-refit-guard") == []


def test_renewing_wakes_the_refit_guard_to_renew() -> None:
    """Before the lock is taken the guard has no renewal due, only its deadline (an hour):
    renewing() wakes it, and it renews the lease from then on."""
    with Coordinator(bind="tcp://127.0.0.1:0") as coordinator:
        renewed = threading.Event()
        watch = guard(FleetClient(coordinator.endpoint), renewed)
        watch.start()
        try:
            watch.renewing()
            assert renewed.wait(DEADLINE_S), "the lease was not renewed"
        finally:
            watch.stop(wait=True)


def test_a_pipe_sends_from_any_thread_and_does_nothing_once_closed() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pipe = Pipe(ctx, "test")
    try:
        senders = [threading.Thread(target=pipe.send, args=(STOP,)) for _ in range(8)]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        assert wait_for(lambda: pipe.end.poll(0) or None, DEADLINE_S, "the commands")
        assert pipe.receive() == [STOP] * 8
    finally:
        pipe.close()
        pipe.send(STOP)   # a late stop() after the thread ended: nothing, no error
        ctx.term()
