"""The command line on the fleet (`--coordinator`), as a user runs it: exit codes, JSON shapes and
messages, against a stand-in coordinator (tests/fleet_standin) and against the real
`rollout-watchdog coordinator` with a node daemon over an emulator engine."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
from daemon_harness import EngineSpec, Node, wait_for
from fleet_standin import StandIn

from rollout_watchdog import FleetClient
from rollout_watchdog.common import protocol
from rollout_watchdog.emulator.testing import free_port


def cli(*args: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rollout_watchdog", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_status_json_and_table(standin: StandIn) -> None:
    out = cli("status", "--coordinator", standin.endpoint, "--json")
    assert out.returncode == 0, out.stderr
    fleet = json.loads(out.stdout)
    assert [n["node_id"] for n in fleet["nodes"]] == ["n1", "n2"]
    assert {"node_id", "reachable", "last_seen", "engines"} <= set(fleet["nodes"][0])
    assert {"weight_version", "serving", "state", "incarnation"} <= set(
        fleet["nodes"][0]["engines"][0])
    table = cli("status", "--coordinator", standin.endpoint, "--node", "n2")
    assert table.returncode == 0, table.stderr
    assert "UNREACHABLE" in table.stdout and standin.commands[-1].node == "n2"


def test_commands_exit_codes_and_messages(standin: StandIn) -> None:
    ep = standin.endpoint
    out = cli("restart", "n1/e0", "--coordinator", ep)
    assert out.returncode == 0 and out.stdout.strip() == "n1: e0: killing, then relaunching"
    assert cli("stop", "e0", "--node", "n1", "--coordinator", ep).returncode == 0
    assert (standin.commands[-1].cmd, standin.commands[-1].node) == ("stop", "n1")
    out = cli("reset", "e0", "--coordinator", ep)
    assert out.returncode == 1 and "NODE/ENGINE" in out.stderr
    out = cli("pause", "--all", "--deadline", "30", "--coordinator", ep)
    assert out.returncode == 0 and out.stdout.startswith("n1: deep probes paused until")
    assert standin.commands[-1].args["deadline_s"] == 30
    standin.answer = lambda c: protocol.Reply(c.request_id, "error", "node n2 did not answer "
                                              "in time", {"nodes": {}, "missing": ["n2"]})
    out = cli("pause", "--all", "--coordinator", ep)
    assert out.returncode == 1 and "n2 did not answer" in out.stderr
    out = cli("resume", "--all", "--node", "n1", "--coordinator", ep)
    assert out.returncode == 1 and (standin.commands[-1].node, standin.commands[-1].args) == (
        "n1", {"all": True})
    out = cli("resume", "--node", "n1", "--coordinator", ep)   # --node alone: all of it
    assert out.returncode == 1 and (standin.commands[-1].node, standin.commands[-1].args) == (
        "n1", {"all": True})
    out = cli("status", "--coordinator", ep, "--control", "ipc:///tmp/x")
    assert out.returncode == 2 and "not allowed with" in out.stderr
    out = cli("status", "--node", "n1")
    assert out.returncode == 1 and "only with --coordinator: --node" in out.stderr


def test_no_coordinator_answers_within_the_timeout() -> None:
    out = cli("status", "--coordinator", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert out.returncode == 1 and "no answer from the coordinator" in out.stderr
    waited = float(out.stderr.split(" within ")[1].split()[0])   # what it waited, shown
    assert 0.05 <= waited <= 0.5, out.stderr   # --timeout's, less the process's own start


def test_main_called_in_a_running_process_keeps_its_timeout(
        capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout counts from the command's own start only as its own process: `cli.main()`
    called in a process up for seconds (this one: collection alone takes them) cut 5 s to
    0.5 s."""
    from rollout_watchdog.cli import main

    assert main(["status", "--coordinator", f"tcp://127.0.0.1:{free_port()}",
                 "--timeout", "1"]) == 1
    assert "within 1 s" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["--control", "--coordinator"])
def test_a_silent_peer_gets_an_exit_within_the_timeout_of_the_commands_start(
        where: str, tmp_path: Path) -> None:
    """DESIGN: each command answers within 5 s (--timeout's default) or exits non-zero with a
    message. The wait began after the interpreter's start and imports: the command exited at
    5.15 s. Now --timeout counts from the process's start (and leaves its exit a margin). A
    ROUTER that takes the command and never answers: a daemon or coordinator that hangs."""
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    endpoint = (f"ipc://{tmp_path}/control" if where == "--control"
                else f"tcp://127.0.0.1:{free_port()}")
    try:
        silent.bind(endpoint)
        started = time.monotonic()
        out = cli("status", where, endpoint, "--timeout", "2")
        took = time.monotonic() - started
        assert out.returncode == 1 and "no answer from the" in out.stderr, out.stderr
        assert silent.poll(0), "the command never reached the silent peer"
        assert took < 2.0, f"exited {took:.2f} s after its start"
    finally:
        silent.close(linger=0)
        ctx.term()


class Lines:
    """The stdout of a running command, a line at a time, each wait bounded."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc, self.lines = proc, queue.Queue[str]()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)

    def take(self, count: int, timeout: float = 15.0) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout
        return [json.loads(self.lines.get(timeout=max(0.01, deadline - time.monotonic())))
                for _ in range(count)]


def test_events_json_follow_a_restart_once(standin: StandIn) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "events", "--json",
                             "--coordinator", standin.endpoint], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out = Lines(proc)
        standin.wait_subscribed(1, timeout=15)
        standin.publish("n1", "b1", 1)
        standin.publish("n1", "b1", 2)
        first = out.take(2)
        assert [(e["node_id"], e["boot"], e["seq"], e["kind"]) for e in first] == [
            ("n1", "b1", 1, "state"), ("n1", "b1", 2, "state")]
        standin.stop()
        standin.publish("n1", "b1", 3)
        standin.sloppy = True   # resends all it holds: the CLI prints none twice
        standin.restart("coordinator-boot-2")
        assert standin.wait_subscribed(2, timeout=15).resume == {
            "n1": protocol.ResumePoint("b1", 2)}
        standin.node_event("n1", "node_reachable")
        rest = out.take(2)
        assert [(e["seq"], e["kind"]) for e in rest] == [(3, "state"), (1, "node_reachable")]
        assert rest[1]["engine"] is None and rest[1]["boot"] == "coordinator-boot-2"
        with pytest.raises(queue.Empty):
            out.take(1, timeout=0.5)
    finally:
        proc.kill()
        proc.wait(10)


def test_the_coordinator_command_with_a_node(make_node: Callable[..., Node]) -> None:
    refused = cli("coordinator", "--bind", f"tcp://0.0.0.0:{free_port()}")
    assert refused.returncode == 1 and "refusing to bind" in refused.stderr
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "coordinator", "--bind",
                             endpoint], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        make_node([EngineSpec("e0")], node_id="n1", top={"coordinator": endpoint}).start()

        def engine_healthy() -> dict[str, object] | None:
            out = cli("status", "--coordinator", endpoint, "--json")
            nodes = json.loads(out.stdout)["nodes"] if out.returncode == 0 else []
            engines = [e for n in nodes for e in n["engines"] if e["state"] == "healthy"]
            return engines[0] if engines else None

        engine = wait_for(engine_healthy, 60, "n1/e0 healthy in the fleet view", interval=0.5)
        assert {"weight_version", "serving", "reachable"} <= set(engine)
        out = cli("pause", "--all", "--coordinator", endpoint)
        assert out.returncode == 0 and out.stdout.startswith("n1: deep probes paused"), out
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_cli_with_curve_keys_and_the_coordinators_routing_flags(
        make_node: Callable[..., Node], tmp_path: Path) -> None:
    """A coordinator started as a user starts one with keys, `--router-url` and
    `--route-after-first-refit`; `status` and `pause` reach it with `--key` and
    `--coordinator-key`, a node links with its own key, and a client without keys is shut out.
    Before the first refit the healthy engine is not serving (the flag), and the router the
    coordinator keeps in step is the one named (nothing listens there)."""
    keys = tmp_path / "keys"
    for name in ("coordinator", "n1", "trainer"):
        assert cli("keygen", str(keys), name).returncode == 0
    (keys / "authorized").mkdir()
    for name in ("n1", "trainer"):
        (keys / "authorized" / f"{name}.key").write_text((keys / f"{name}.key").read_text())
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    router_url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "coordinator", "--bind",
                             endpoint, "--keys", str(keys), "--router-url", router_url,
                             "--route-after-first-refit"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    keyed = ("--coordinator", endpoint, "--key", str(keys / "trainer.key_secret"),
             "--coordinator-key", str(keys / "coordinator.key"))
    try:
        make_node([EngineSpec("e0")], node_id="n1", top={
            "coordinator": endpoint, "key": str(keys / "n1.key_secret"),
            "coordinator_key": str(keys / "coordinator.key")}).start()

        def engine_healthy() -> dict[str, object] | None:
            out = cli("status", *keyed, "--json")
            nodes = json.loads(out.stdout)["nodes"] if out.returncode == 0 else []
            engines = [e for n in nodes for e in n["engines"] if e["state"] == "healthy"]
            return engines[0] if engines else None

        engine = wait_for(engine_healthy, 60, "n1/e0 healthy in the fleet view", interval=0.5)
        assert engine["serving"] is False and engine["weight_version"] is None
        out = cli("pause", "--all", *keyed)
        assert out.returncode == 0 and out.stdout.startswith("n1: deep probes paused"), out
        shut_out = cli("status", "--coordinator", endpoint, "--timeout", "3")
        assert shut_out.returncode != 0 and "requires CURVE keys" in shut_out.stderr, shut_out

        client = FleetClient(endpoint, str(keys / "trainer.key_secret"),
                             str(keys / "coordinator.key"))
        router = client.call("ping")[1]["router"]
        assert router["router_url"] == router_url and router["listed_count"] == 0
    finally:
        proc.kill()
        proc.wait(10)
