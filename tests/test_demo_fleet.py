"""The README's fleet demo: `rollout-watchdog demo --fleet` runs end to end, its timeline says
what a user would check, and it leaves no process behind, also when interrupted."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

TAG = "ROLLOUT_WATCHDOG_TEST_TAG"   # inherited by every process the demo starts


def tagged(tag: str) -> list[int]:
    """Live processes whose environment carries our tag."""
    needle = f"{TAG}={tag}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def demo_env(tag: str) -> dict[str, str]:
    return {**os.environ, TAG: tag}


def workdir_of(text: str) -> Path:
    match = re.search(r"files in (\S+)", text)
    assert match, text
    return Path(match.group(1))


def first(pattern: str, text: str, after: int = 0) -> int:
    """Where `pattern` first matches in `text` from `after` on; fails naming it if nowhere."""
    match = re.compile(pattern, re.M).search(text, after)
    assert match, f"no line matching {pattern!r} after offset {after} in:\n{text}"
    return match.start()


def test_fleet_demo_tells_the_story_and_leaves_nothing() -> None:
    tag = uuid.uuid4().hex
    out = subprocess.run([sys.executable, "-m", "rollout_watchdog", "demo", "--fleet"],
                         capture_output=True, text=True, timeout=300, env=demo_env(tag))
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    for node in ("node-a", "node-b"):
        first(rf"{node}/e1#1 +starting -> healthy \[probe_passed\]", text)
    # the SIGKILLed engine: detected (with its cause and incarnation), relaunched, healthy
    crash = first(r"node-b/e0#1 +healthy -> stopping \[exited\]  main process \d+ exited "
                  r"\(killed by SIGKILL\)", text)
    first(r"node-b/e0#2 +starting -> healthy", text, crash)
    # the SIGKILLed daemon: its node unreachable, then back with the engines adopted as they were
    gone = first(r"node-b +node_unreachable", text, crash)
    first(r"UNREACHABLE", text, gone)
    back = first(r"node-b +node_reachable", text, gone)
    first(r"node-b/e0#2 +adopted", text, gone)
    first(r"node-b/e1#1 +adopted", text, gone)
    first(r"node node-b: 2 engine\(s\), reachable", text, back)
    # refits: every engine synced at v1, the relaunched engine kept out until v2 synced it
    first(r"node-a/e0 at v1: ", text)
    first(r"node-b/e0#2 is healthy with pending weights, kept out of the router", text, crash)
    first(r"node-b/e0 at v2: ", text, crash)
    first(r"^refit v1: 4 engines synced in [\d.]+ s, each generating the same text at v1",
          text)
    first(r"^refit v2: 4 engines synced .* at v2; the router lists all 4", text)
    assert "engines adopted with the same incarnations: e0#2" in text
    assert "node daemons' exit codes: node-a 0, node-b 0" in text
    assert tagged(tag) == []
    assert not workdir_of(text).exists()


def test_fleet_demo_interrupted_leaves_nothing() -> None:
    """Ctrl-C while node-b's engines are orphaned (its daemon SIGKILLed): all gone all the same."""
    tag = uuid.uuid4().hex
    # SIGINT's default action back in the demo: a suite started as a background job (`... &`)
    # inherits SIGINT ignored, and Python then leaves it ignored (the demo ran on and exited 0)
    proc = subprocess.Popen([sys.executable, "-m", "rollout_watchdog", "demo", "--fleet"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=demo_env(tag),
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout or ()],
                     daemon=True).start()
    seen: list[str] = []
    try:
        while "SIGKILL to node-b's daemon" not in (seen[-1] if seen else ""):
            seen.append(lines.get(timeout=120))
        assert len(tagged(tag)) > 4  # node-a's daemon and engines, node-b's orphans
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, "".join(seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert tagged(tag) == []
    assert not workdir_of("".join(seen)).exists()
