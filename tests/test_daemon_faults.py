"""The real daemon against real emulator engines, each fault injected abruptly."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable

import psutil
from daemon_harness import EngineSpec, Node, emulator_command, pid_gone, wait_for

MakeNode = Callable[..., Node]


def test_sigkill_of_main_process_is_detected_and_engine_relaunched(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    first = node.wait_state("e0", "healthy")
    os.kill(first["pid"], signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert again["pid"] != first["pid"]
    assert again["restarts"] == 1
    assert again["last_failure"]["cause"] == "exited"
    assert "SIGKILL" in again["last_failure"]["detail"]
    down = node.wait_event("e0", kind="state", to="stopping")
    assert down["incarnation"] == 1 and down["cause"] == "exited"
    assert down["exit_signal"] == "SIGKILL" and "exit_code" not in down   # as fields too


def test_dead_scheduler_of_a_zombie_server_is_detected(make_node: MakeNode) -> None:
    """Old SGLang: the HTTP server outlives its scheduler. The scheduler's exit is fatal."""
    node = make_node([EngineSpec("e0", flags=("--dead-scheduler", "zombie"))]).start()
    first = node.wait_state("e0", "healthy")
    scheduler = node.emulator("e0", "/_emulator/info").json()["scheduler_pid"]
    os.kill(scheduler, signal.SIGKILL)
    node.wait_state("e0", "healthy", incarnation=2)
    failure = node.engine("e0")["last_failure"]
    assert failure["cause"] == "exited" and str(scheduler) in failure["detail"]
    assert pid_gone(first["pid"])  # the zombie server itself was killed before the relaunch


def test_sigstopped_engine_fails_its_probes_and_is_killed(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    first = node.wait_state("e0", "healthy")
    os.kill(first["pid"], signal.SIGSTOP)
    node.wait_event("e0", kind="state", to="suspect", cause="probe_failed")
    node.wait_state("e0", "healthy", incarnation=2, timeout=40)
    assert node.engine("e0")["last_failure"]["cause"] == "probe_failed"
    assert pid_gone(first["pid"])


def test_generation_stall_is_detected_while_http_lives(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    assert node.emulator("e0", "/_emulator/fault", {"fault": "stall_generation"}).ok
    assert node.emulator("e0", "/model_info").status_code == 200  # HTTP is alive
    node.wait_state("e0", "healthy", incarnation=2, timeout=40)
    assert node.engine("e0")["last_failure"]["cause"] == "probe_failed"


def test_crash_loop_ends_in_failed_and_reset_brings_it_back(make_node: MakeNode,
                                                            tmp_path) -> None:
    flag = tmp_path / "model-is-fixed"
    spec = EngineSpec("e0")
    spec.command = ["sh", "-c", f'test -f {flag} || exit 3; exec "$@"', "engine",
                    *emulator_command(spec.port)]
    node = make_node([spec], restart={"max_restarts": 2, "backoff_initial_s": 0.05}).start()
    failed = node.wait_state("e0", "failed", timeout=30)
    assert failed["restarts"] == 2 and failed["incarnation"] == 3
    assert "budget" in node.wait_event("e0", kind="state", to="failed")["detail"]
    assert "exit code 3" in failed["last_failure"]["detail"]
    # it stays failed: nothing relaunches it
    assert node.engine("e0")["incarnation"] == 3
    flag.touch()
    node.client.call("reset", {"engine": "e0"})
    healthy = node.wait_state("e0", "healthy", incarnation=4)
    assert healthy["pid"]
    assert node.wait_event("e0", kind="state", to="starting", cause="reset")


def test_slow_start_past_the_startup_deadline(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0", flags=("--startup-delay", "60"))],
                     probe={"startup_timeout_s": 2.0}).start()
    event = node.wait_event("e0", kind="state", to="stopping", timeout=20)
    assert event["cause"] == "startup_timeout" and event["incarnation"] == 1
    node.wait_state("e0", "starting", incarnation=2)


def test_sigterm_ignored_escalates_to_sigkill(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0", flags=("--ignore-sigterm",))],
                     restart={"grace_s": 1.0}).start()
    first = node.wait_state("e0", "healthy")
    started = time.monotonic()
    node.client.call("stop", {"engine": "e0"})
    node.wait_state("e0", "stopped", timeout=15)
    assert time.monotonic() - started >= 1.0  # the grace period was given
    assert pid_gone(first["pid"])
    stopped = node.wait_event("e0", kind="state", to="stopped")
    assert "SIGKILL" in stopped["detail"]


def orphan_of(node: Node) -> int:
    """The engine's orphan, once spawned: the emulator spawns it just after it reports ready,
    so a passing probe may come first (a loaded host)."""
    pids: list[int] = wait_for(lambda: node.emulator("e0", "/_emulator/info").json()[
        "orphan_pids"], 30, "the orphan spawned")
    return pids[0]


def test_orphan_is_killed_before_the_relaunch(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0", flags=("--orphan",))]).start()
    first = node.wait_state("e0", "healthy")
    orphan = orphan_of(node)
    assert os.getsid(orphan) != os.getsid(first["pid"])  # it left the engine's session
    os.kill(first["pid"], signal.SIGKILL)
    node.wait_state("e0", "healthy", incarnation=2)
    assert pid_gone(orphan)
    # The daemon's own record: the orphan was signalled, and the kill completed (every
    # process it knew gone), before the next incarnation started. (Not a watcher thread's
    # clock against psutil's create_time: that thread wakes late under load, and create_time
    # is built on /proc/stat's whole-second boot time.)
    events = node.events("e0")
    killed = next(i for i, e in enumerate(events) if e["kind"] == "signal_sent"
                  and str(orphan) in re.findall(r"\d+", e["detail"]))
    done = next(i for i, e in enumerate(events) if e["kind"] == "state"
                and e["from"] == "stopping" and e["incarnation"] == 1)
    started = next(i for i, e in enumerate(events) if e["kind"] == "state"
                   and e["to"] == "starting" and e["incarnation"] == 2)
    assert killed < done < started
    # the new incarnation has its own orphan, which the daemon now tracks
    new_orphan = orphan_of(node)
    node.client.call("stop", {"engine": "e0"})
    node.wait_state("e0", "stopped")
    assert pid_gone(new_orphan)


def test_paused_probes_leave_a_stall_alone_but_liveness_still_acts(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    first = node.wait_state("e0", "healthy")
    ack = node.client.call("pause", {"engine": "e0", "deadline_s": 120})
    assert ack["paused"] == ["e0"]
    assert node.wait_event("e0", kind="paused")
    node.emulator("e0", "/_emulator/fault", {"fault": "stall_generation"})
    # Watch for several probe periods (threshold x (interval + timeout) = 2.4 s): no reaction.
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        e = node.engine("e0")
        assert e["state"] == "healthy" and e["paused"], e
        time.sleep(0.1)
    os.kill(first["pid"], signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert again["paused"] is False  # a pause belongs to the incarnation it was given to
    assert again["last_failure"]["cause"] == "exited"


def test_pause_deadline_expires(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    node.client.call("pause", {"all": True, "deadline_s": 0.5})
    node.wait_event("e0", kind="pause_expired", timeout=10)
    assert node.engine("e0")["paused"] is False


def test_daemon_sigkill_and_restart_adopts_running_engines(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0"), EngineSpec("e1")]).start()
    pids = {e: node.wait_state(e, "healthy")["pid"] for e in ("e0", "e1")}
    node.client.call("pause", {"engine": "e1", "deadline_s": 300})
    node.kill_daemon()
    assert all(not pid_gone(p) for p in pids.values())
    node.start()
    for engine, pid in pids.items():
        e = node.engine(engine)
        assert (e["pid"], e["incarnation"], e["state"]) == (pid, 1, "healthy")
    assert node.engine("e1")["paused"] is True  # the pause survived the daemon restart
    assert node.wait_event("e0", kind="adopted")
    # and the adopted engine is supervised exactly as before
    os.kill(pids["e0"], signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert "exit status unknown" in again["last_failure"]["detail"] or \
        again["last_failure"]["cause"] == "exited"


def test_a_state_file_behind_its_engines_gets_the_live_incarnation_adopted_not_killed(
        make_node: MakeNode) -> None:
    """The daemon SIGKILLed with its state file behind the engines (a full disk kept it at
    incarnation 1 while incarnation 2 ran): the restarted daemon killed the healthy engine as
    an escapee of "an incarnation that is over" and handed its number out again (hostile run
    5). Now the incarnation whose processes carry its marker is adopted, the same process,
    and a number is never handed out twice (test_containment_daemon: a lost or cut file)."""
    node = make_node([EngineSpec("e0"), EngineSpec("e1")]).start()
    node.wait_state("e0", "healthy")
    node.wait_state("e1", "healthy")
    state = node.state_dir / "state.json"
    old = state.read_text()
    node.client.call("restart", {"engine": "e0"})
    pids = {"e0": node.wait_state("e0", "healthy", incarnation=2)["pid"],
            "e1": node.engine("e1")["pid"]}
    node.kill_daemon()
    state.write_text(old)
    node.start()
    assert {e: (node.engine(e)["pid"], node.engine(e)["incarnation"]) for e in pids} == {
        "e0": (pids["e0"], 2), "e1": (pids["e1"], 1)}
    assert all(not pid_gone(pid) for pid in pids.values())
    node.wait_state("e0", "healthy", incarnation=2)
    node.client.call("restart", {"engine": "e0"})
    assert node.wait_state("e0", "healthy", incarnation=3)["pid"] != pids["e0"]


def test_a_follower_behind_at_a_daemon_restart_gets_the_rest_of_the_previous_run_once(
        make_node: MakeNode) -> None:
    """An `events` follower that had not read the last events when the daemon was SIGKILLed
    and started again was served from the new run's first event: the previous run's tail
    (here, a whole restart of e0) was lost to it, with no `gap` (hostile run 5). Now it gets
    that tail first, under the previous boot, each event once, then the new run's."""
    node = make_node([EngineSpec("e0")]).start()
    node.wait_state("e0", "healthy")
    seen = node.client.call("events", {"since": 0, "wait_s": 0})
    boot, since = seen["boot"], seen["next"]
    node.client.call("restart", {"engine": "e0"})
    node.wait_state("e0", "healthy", incarnation=2)
    unread = node.client.call("events", {"boot": boot, "since": since, "wait_s": 0})
    assert unread["boot"] == boot and unread["events"]   # (what the follower has not read)
    node.kill_daemon()
    node.start()
    served, following = [], boot
    while following == boot:
        answer = node.client.call("events", {"boot": following, "since": since, "wait_s": 0})
        following, since = answer["boot"], answer["next"]
        served += answer["events"] if following == boot else []
    assert served[:len(unread["events"])] == unread["events"]
    assert not any(e["kind"] == "gap" for e in served)
    assert ("state", 2, "healthy") in [(e["kind"], e["incarnation"], e["to"]) for e in served]
    assert since >= 1 and answer["events"][0]["kind"] != "gap"   # then this run's, from 1


def test_engine_that_died_while_the_daemon_was_down_is_recovered(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0")]).start()
    first = node.wait_state("e0", "healthy")
    node.kill_daemon()
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(lambda: pid_gone(first["pid"]), 10, "the engine to die")
    node.start()
    node.wait_state("e0", "healthy", incarnation=2)


def test_sigterm_to_the_daemon_stops_every_engine(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0"), EngineSpec("e1", flags=("--ignore-sigterm",))],
                     restart={"grace_s": 1.0}).start()
    procs = []
    for engine in ("e0", "e1"):
        pid = node.wait_state(engine, "healthy")["pid"]
        parent = psutil.Process(pid)
        procs += [parent, *parent.children(recursive=True)]
    assert node.stop_daemon() == 0
    for proc in procs:
        assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE, proc


def test_deferred_engine_waits_for_restart(make_node: MakeNode) -> None:
    node = make_node([EngineSpec("e0", extra={"restart_policy": "deferred"})]).start()
    first = node.wait_state("e0", "healthy")
    os.kill(first["pid"], signal.SIGKILL)
    waiting = node.wait_state("e0", "backoff")
    assert waiting["deferred_waiting"] is True and pid_gone(first["pid"])
    node.client.call("restart", {"engine": "e0"})
    node.wait_state("e0", "healthy", incarnation=2)


def test_external_engine_is_killed_but_not_relaunched(make_node: MakeNode) -> None:
    import subprocess

    from daemon_harness import EMULATOR_ENV, emulator_command, free_port

    port = free_port()
    engine = subprocess.Popen(emulator_command(port), env={**os.environ, **EMULATOR_ENV},
                              start_new_session=True)
    try:
        node = make_node([]).start()
        node.engines["ray0"] = EngineSpec("ray0", port=port)
        node.client.call("register", {"engine": "ray0", "url": f"http://127.0.0.1:{port}",
                                      "pid": engine.pid})
        node.wait_state("ray0", "healthy", timeout=30)
        node.emulator("ray0", "/_emulator/fault", {"fault": "stall_generation"})
        stopped = node.wait_state("ray0", "stopped", timeout=30)
        assert stopped["last_failure"]["cause"] == "probe_failed"
        assert node.wait_event("ray0", kind="owner_restart_needed")
        engine.wait(timeout=10)  # killed, and not relaunched by the daemon
        assert node.engine("ray0")["incarnation"] == 1
    finally:
        if engine.poll() is None:
            engine.kill()
            engine.wait()


def test_broken_config_is_refused_with_a_clear_message(tmp_path) -> None:
    import subprocess
    import sys

    config = tmp_path / "bad.toml"
    config.write_text('[[engine]]\nid = "e0"\nurl = "http://127.0.0.1:1"\n'
                      '[probe]\nhealth_timeout_s = 0\n')
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "run", "--config",
                          str(config)], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "engine 'e0': missing key 'command'" in out.stderr
    assert "[probe]: key 'health_timeout_s' must be > 0" in out.stderr
    assert "Traceback" not in out.stderr


def test_garbage_on_the_control_socket_is_answered_or_dropped(make_node: MakeNode) -> None:
    import json

    import zmq

    node = make_node([]).start()
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(node.control)
    try:
        for payload in (b"\xff\xfe garbage", b"[1, 2, 3]", b'{"cmd": 5}',
                        b'{"v": 99, "cmd": "status"}', b'{"cmd": "frobnicate"}',
                        b'{"cmd": "pause", "args": {"engine": "nope"}}',
                        b'{"cmd": "pause", "args": {"all": true, "deadline_s": "soon"}}'):
            dealer.send(payload)
            assert dealer.poll(5000), payload
            reply = json.loads(dealer.recv())
            assert reply["status"] == "error" and reply["reason"], (payload, reply)
        dealer.send_multipart([b"a", b"b", b"c"])        # wrong framing: dropped
        dealer.send(b"x" * (128 * 1024))                  # oversized: the connection is cut
    finally:
        dealer.close()
    assert node.client.call("status")["node_id"] == "test-node"
    assert node.proc is not None and node.proc.poll() is None


def test_liveness_only_engine(make_node: MakeNode) -> None:
    """A multi-node follower part runs with deep probes off: its processes are still watched."""
    node = make_node([EngineSpec("e0", extra={"probe": {"health_path": ""}})]).start()
    first = node.wait_state("e0", "healthy")
    assert "liveness alone" in node.wait_event("e0", kind="state", to="healthy")["detail"]
    os.kill(first["pid"], signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert again["last_failure"]["cause"] == "exited"


def test_relaunch_keeps_argv_env_ports_and_gpus(make_node: MakeNode) -> None:
    spec = EngineSpec("e0", extra={"gpus": [3], "env": {"ENGINE_FLAVOUR": "blue"}})
    node = make_node([spec]).start()

    def launch_of(pid: int) -> tuple[list[str], str | None, str | None]:
        proc = psutil.Process(pid)
        env = proc.environ()
        return proc.cmdline(), env.get("CUDA_VISIBLE_DEVICES"), env.get("ENGINE_FLAVOUR")

    first = node.wait_state("e0", "healthy")
    before = launch_of(first["pid"])
    assert before[1:] == ("3", "blue")
    os.kill(first["pid"], signal.SIGKILL)
    again = node.wait_state("e0", "healthy", incarnation=2)
    assert launch_of(again["pid"]) == before
    assert node.engine("e0")["ports"] == [spec.port]


def test_progress_probe_catches_a_token_counter_that_stops(make_node: MakeNode) -> None:
    """Requests running, no token generated for progress_timeout_s: failed as `stalled`, even
    though the health probe alone would take far longer (threshold set out of reach here)."""
    node = make_node([EngineSpec("e0", flags=("--enable-metrics", "--token-latency-ms", "5"))],
                     probe={"progress_path": "/metrics", "progress_timeout_s": 2.0,
                            "failure_threshold": 1000}).start()
    node.wait_state("e0", "healthy")

    def long_generation() -> None:
        with contextlib.suppress(Exception):  # the engine is killed under it: expected
            node.emulator("e0", "/generate", {"text": "go", "sampling_params": {
                "max_new_tokens": 4000, "ignore_eos": True}}, timeout=120)

    threading.Thread(target=long_generation, daemon=True).start()
    wait_for(lambda: "sglang:num_running_reqs{" in (text := node.emulator("e0", "/metrics").text)
             and any(line.startswith("sglang:num_running_reqs") and not line.endswith(" 0.0")
                     for line in text.splitlines()), 20, "a running request")
    node.emulator("e0", "/_emulator/fault", {"fault": "stall_generation"})
    down = node.wait_event("e0", kind="state", to="stopping", timeout=30)
    assert down["cause"] == "stalled" and "request(s) running" in down["detail"]
