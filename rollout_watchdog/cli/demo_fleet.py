"""`rollout-watchdog demo --fleet`: a two-node fleet on this machine, over CURVE.

A coordinator (embedded in this process, as a trainer would run it) with a real sglang-router
(when the package is installed), two node daemons (`rollout-watchdog run`, each a process of its
own over emulated engines) linked to it with keys made by `keygen`, and a `FleetClient`
following the fleet's events. This process is also the trainer: it refits every engine to v1
over a gloo weight-update group, SIGKILLs an engine (detected, relaunched, kept out of the
router with pending weights), refits to v2 (the group rebuilt with the new incarnation, every
engine synced and back in the router), then SIGKILLs a node daemon and starts it again, and
prints what the client saw. Everything is real: processes, signals, sockets, CURVE, torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rollout_watchdog.cli.demo import (
    Narrator,
    describe,
    interrupt_on_sigterm,
    node_config,
    shielded,
    start_daemon,
    stop_daemon,
    sweep,
)
from rollout_watchdog.cli.demo_refit import DemoRouter, generate, refit
from rollout_watchdog.cli.render import fleet_table
from rollout_watchdog.common.errors import CoordinatorUnavailable, RolloutWatchdogError
from rollout_watchdog.common.keys import keygen
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.emulator.testing import free_port
from rollout_watchdog.refit_bridge.client import FleetClient
from rollout_watchdog.refit_bridge.coordinator import Coordinator
from rollout_watchdog.refit_bridge.router import normalize_url
from rollout_watchdog.refit_bridge.stream import EventStream
from rollout_watchdog.refit_bridge.views import EngineView, FleetEvent

NODES = ("node-a", "node-b")
VICTIM = "node-b"          # the node whose engine, then whose daemon, is SIGKILLed
CLIENT = "driver"          # the client's key name
NODE_TIMEOUT_S = 3.0       # silence after which the coordinator marks a node unreachable
PUMP_S = 0.2               # how long one look at the event stream waits for events


def log_to(path: Path) -> None:
    """What the coordinator in this process logs goes to `path`, as a standalone one's would
    go to its journal; the terminal shows the story."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("rollout_watchdog")
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def make_keys(keys: Path) -> Path:
    """CURVE keys as an operator makes them with `rollout-watchdog keygen`: the coordinator's,
    one per node and one for the client, and the public keys let in under `authorized/`."""
    keygen(keys, "coordinator")
    (keys / "authorized").mkdir()
    for name in (*NODES, CLIENT):
        public, _ = keygen(keys, name)
        shutil.copy(public, keys / "authorized" / public.name)
    return keys


class FleetTimeline(Narrator):
    """Prints each event the client hears, once: time since the start, NODE/ENGINE#INC (or
    the node, for the coordinator's node events), what happened and why."""

    def __init__(self, stream: EventStream) -> None:
        super().__init__()
        self.stream = stream
        self.events: list[tuple[float, FleetEvent]] = []   # (when the client heard it, it)

    def pump(self) -> None:
        end = time.monotonic() + PUMP_S
        while time.monotonic() < end:
            try:
                event = next(self.stream)   # StopIteration after PUMP_S without an event
            except StopIteration:
                return
            heard = time.time()
            self.events.append((heard, event))
            who = event.node_id if event.engine is None else \
                f"{event.node_id}/{event.engine}#{event.incarnation}"
            print(f"{self.stamp(event.ts or heard)}  {who:<13} {describe(event.raw)}",
                  flush=True)

    def find(self, match: Callable[[FleetEvent], bool], start: int = 0
             ) -> tuple[float, FleetEvent] | None:
        """The first event heard (from index `start` on) that matches, with when it was."""
        return next(((t, e) for t, e in self.events[start:] if match(e)), None)


class Daemons:
    """The demo's node daemons, one process per node, each started from its config."""

    def __init__(self, workdir: Path, endpoint: str, keys: Path, engines: int) -> None:
        self.workdir = workdir
        self.configs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for node in NODES:
            (workdir / node).mkdir()
            top = [f'coordinator = "{endpoint}"', f'key = "{keys / node}.key_secret"',
                   f'coordinator_key = "{keys}/coordinator.key"']
            config = workdir / node / "node.toml"
            config.write_text(node_config(workdir / node, node, [free_port() for _ in
                                                                 range(engines)], top))
            self.configs[node] = config

    def start(self, node: str) -> None:
        self.procs[node] = start_daemon(self.configs[node], self.workdir,
                                        self.workdir / node / "daemon.log")

    def kill(self, node: str) -> None:
        self.procs[node].kill()
        self.procs[node].wait(timeout=10)

    def stop(self) -> dict[str, int]:
        """SIGTERM to each (it stops its engines); their exit codes."""
        return {node: stop_daemon(proc) for node, proc in self.procs.items()}


def _engines(client: FleetClient) -> dict[str, EngineView]:
    try:
        return {e.name: e for e in client.engines()}
    except CoordinatorUnavailable:
        return {}


def _healthy(client: FleetClient, incarnations: dict[str, int]) -> bool:
    view = _engines(client)
    return all(name in view and view[name].state == EngineState.HEALTHY and view[name].reachable
               and view[name].incarnation == n for name, n in incarnations.items())


class Story:
    """The demo's steps, each printing what it does and returning its summary line."""

    def __init__(self, timeline: FleetTimeline, client: FleetClient, daemons: Daemons,
                 engines: int, router: DemoRouter | None) -> None:
        self.timeline, self.client, self.daemons, self.engines = timeline, client, daemons, engines
        self.router = router

    def start(self) -> str:
        self.timeline.say(f"starting node daemons {' and '.join(NODES)}: each launches "
                          f"{self.engines} engines and dials the coordinator")
        for node in NODES:
            self.daemons.start(node)
        self.timeline.until("every engine of the fleet healthy", lambda: _healthy(
            self.client, {f"{node}/e{i}": 1 for node in NODES for i in range(self.engines)}))
        return f"{len(NODES)} nodes joined, {len(NODES) * self.engines} engines healthy"

    def refit(self, version: str, seed: int) -> str:
        self.timeline.say(f"refit to {version}: lock, fleet-wide probe pause, weight-update "
                          "group (gloo, this process as rank 0), broadcast, commit")
        took, members = refit(self.client, version, seed)
        self.timeline.pump()
        view = _engines(self.client)
        texts = {name: generate(str(e.url)) for name, e in sorted(view.items())}
        for name, (text, at) in texts.items():
            self.timeline.say(f"{name} at {at}: {text!r}")
        if {at for _, at in texts.values()} != {version} or len(
                {text for text, _ in texts.values()}) != 1:
            raise RuntimeError(f"the engines do not all generate alike at {version}: {texts}")
        routed = ""
        if self.router is not None:
            router = self.router
            want = {normalize_url(str(e.url)) for e in view.values()}
            self.timeline.until("every engine in the router", lambda: router.workers() == want)
            routed = f"; the router lists all {len(want)}"
        return (f"refit {version}: {len(members)} engines synced in {took:.2f} s, each "
                f"generating the same text at {version}{routed}")

    def crash(self) -> str:
        name = f"{VICTIM}/e0"
        victim = _engines(self.client)[name]
        if victim.pid is None:
            raise RuntimeError(f"{name} has no pid in the fleet view")
        self.timeline.say(f"injecting a crash: SIGKILL to {name}'s main process "
                          f"(pid {victim.pid})")
        mark = len(self.timeline.events)
        killed_at = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        self.timeline.until(f"{name} detected, relaunched and healthy", lambda: _healthy(
            self.client, {name: victim.incarnation + 1}) and self.timeline.find(
            lambda e: _of(e, name) and e.to == EngineState.HEALTHY, mark) is not None)
        heard, detected = self.timeline.find(
            lambda e: _of(e, name) and e.to == EngineState.STOPPING, mark) or (0.0, None)
        if detected is None or detected.ts is None:
            raise RuntimeError(f"the client heard no crash of {name}")
        reborn = _engines(self.client)[name]
        if reborn.serving or reborn.weight_version is not None:
            raise RuntimeError(f"{name} serves after its relaunch, without weights: {reborn}")
        kept_out = ""
        if self.router is not None:
            if normalize_url(str(victim.url)) in self.router.workers():
                raise RuntimeError(f"{name} is in the router with pending weights")
            kept_out = ", kept out of the router"
        self.timeline.say(f"{name}#{reborn.incarnation} is healthy with pending weights"
                          f"{kept_out} until the next refit")
        return (f"crash of {name} detected {1000 * (detected.ts - killed_at):.1f} ms after the "
                f"SIGKILL, heard by the client {1000 * (heard - killed_at):.1f} ms after; "
                f"relaunched as incarnation {victim.incarnation + 1} with pending "
                f"weights{kept_out}")

    def node_restart(self) -> str:
        before = {e.id: (e.incarnation, e.pid) for e in self.client.engines(node=VICTIM)}
        boot = self.client.nodes(node=VICTIM)[0].boot
        self.timeline.say(f"SIGKILL to {VICTIM}'s daemon: its engines run on, unsupervised, "
                          "and the coordinator hears nothing from the node")
        mark = len(self.timeline.events)
        self.daemons.kill(VICTIM)
        self.timeline.until(f"{VICTIM} unreachable", lambda: self._node_event(
            "node_unreachable", mark) is not None)
        print(fleet_table(self.client.status(node=VICTIM)), flush=True)
        self.timeline.say(f"starting {VICTIM}'s daemon again: it adopts the engines it finds "
                          "running")
        self.daemons.start(VICTIM)

        def back() -> bool:
            node = self.client.nodes(node=VICTIM)[0]
            adopted = {e.engine for _, e in self.timeline.events[mark:]
                       if e.node_id == VICTIM and e.kind == "adopted"}
            return (node.reachable and node.boot != boot and adopted >= set(before)
                    and self._node_event("node_reachable", mark) is not None)
        self.timeline.until(f"{VICTIM} reachable again, its engines adopted", back)
        after = {e.id: (e.incarnation, e.pid) for e in self.client.engines(node=VICTIM)}
        if after != before:
            raise RuntimeError(f"{VICTIM}'s engines were not adopted as they were: before "
                               f"{before}, after {after}")
        gone, came = self._node_event("node_unreachable", mark), \
            self._node_event("node_reachable", mark)
        away = (came.ts or 0.0) - (gone.ts or 0.0) if gone and came else 0.0
        kept = ", ".join(f"{e}#{inc} (pid {pid})" for e, (inc, pid) in sorted(after.items()))
        return (f"{VICTIM}'s daemon SIGKILLed and started again: {VICTIM} unreachable for "
                f"{away:.1f} s, then reachable; engines adopted with the same incarnations: "
                f"{kept}")

    def _node_event(self, kind: str, start: int) -> FleetEvent | None:
        found = self.timeline.find(lambda e: e.node_id == VICTIM and e.kind == kind, start)
        return found[1] if found else None


def _of(event: FleetEvent, name: str) -> bool:
    return f"{event.node_id}/{event.engine}" == name


def run_fleet_demo(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="rollout-watchdog-fleet-demo-"))
    print(f"demo --fleet: a coordinator (CURVE), {len(NODES)} node daemons with {args.engines} "
          f"emulated SGLang engines each, a client following events; files in {workdir}")
    restore = interrupt_on_sigterm()
    coordinator: Coordinator | None = None
    stream: EventStream | None = None
    daemons: Daemons | None = None
    router: DemoRouter | None = None
    try:
        log_to(workdir / "coordinator.log")
        keys = make_keys(workdir / "keys")
        if DemoRouter.available():
            router = DemoRouter(workdir)
        else:
            print("(sglang-router is not installed: the demo runs without a router)")
        coordinator = Coordinator(bind="tcp://127.0.0.1:0", keys=str(keys),
                                  node_timeout_s=NODE_TIMEOUT_S,
                                  router_url=router.url if router else None)
        coordinator.start()
        client = FleetClient(coordinator.endpoint, key=str(keys / f"{CLIENT}.key_secret"),
                             coordinator_key=str(keys / "coordinator.key"))
        stream = client.events(idle_s=PUMP_S)
        timeline = FleetTimeline(stream)
        timeline.say(f"coordinator on {coordinator.endpoint}; keys in {keys}")
        daemons = Daemons(workdir, coordinator.endpoint, keys, args.engines)
        story = Story(timeline, client, daemons, args.engines, router)
        summary = [story.start(), story.refit("v1", seed=1), story.crash(),
                   story.refit("v2", seed=2), story.node_restart()]
        print("\nthe fleet, as the coordinator sees it:\n" + fleet_table(client.status()))
        timeline.say("stopping the node daemons (each stops its engines) and the coordinator")
        codes = daemons.stop()
        print("\n" + "\n".join(summary))
        print("node daemons' exit codes: " + ", ".join(f"{n} {c}" for n, c in codes.items()))
        return 0
    except (TimeoutError, RolloutWatchdogError, RuntimeError, OSError) as exc:
        print(f"demo failed: {exc}; logs: {workdir}/coordinator.log and "
              f"{workdir}/NODE/daemon.log", file=sys.stderr)
        args.keep = True
        return 1
    finally:
        restore()
        with shielded():
            if daemons is not None:
                daemons.stop()
            if stream is not None:
                stream.close()
            if coordinator is not None:
                coordinator.stop()
            if router is not None:
                router.stop()
            sweep(workdir)
            if args.keep:
                print(f"files kept in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
