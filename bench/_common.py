"""What the benchmarks share: the command-line frame (the exact command line first, a time limit,
Ctrl-C), a real daemon over real emulator engines that leaves no process behind whatever happens,
an event follower, and the min / median / max summary.

The daemon and engine plumbing is the test harness's (`tests/daemon_harness.py`), imported rather
than copied, so the benchmarks drive the daemon exactly as the integration tests do.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
for _path in (str(REPO / "tests"), str(REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from daemon_harness import EngineSpec, Node, wait_for  # noqa: E402

# The emulator's own fault client; `fault(url, name)` is the benchmarks' name for it.
from rollout_watchdog.emulator.testing import emulator_info  # noqa: E402
from rollout_watchdog.emulator.testing import inject_fault as fault  # noqa: E402

__all__ = ["EngineSpec", "EventStream", "Fleet", "KillRecord", "Summary", "TimeLimit",
           "bench_main", "emulator_info", "engines", "fault", "goal", "kill_and_follow",
           "parse_args", "step", "summary", "wait_for"]

# Every process a benchmark starts carries this variable (the daemon passes its environment to
# its engines), so the final sweep finds them all, orphans in other sessions included.
MARKER_ENV = "ROLLOUT_WATCHDOG_BENCH_RUN"


class TimeLimit(Exception):
    """The run went past --time-limit: stop measuring, clean up, exit non-zero."""


# ---------------------------------------------------------------------- command-line frame

def parse_args(doc: str, *, repeat: int, quick_repeat: int, time_limit: float,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """--repeat N, --quick (fewer repetitions, shorter windows), --time-limit S (hard stop)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0], epilog=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=None,
                        help=f"repetitions (default {repeat}; {quick_repeat} with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run, for a smoke test")
    parser.add_argument("--time-limit", type=float, default=time_limit,
                        help=f"stop (and clean up) after this many seconds (default "
                             f"{time_limit:g})")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (config, daemon and engine logs)")
    if extra:
        extra(parser)
    args = parser.parse_args()
    if args.repeat is None:
        args.repeat = quick_repeat if args.quick else repeat
    if args.repeat < 1:
        parser.error("--repeat must be >= 1")
    return args


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def _raise_time_limit(signum: int, frame: FrameType | None) -> None:
    raise TimeLimit("time limit reached")


def code_version() -> str:
    """The commit measured, and whether the package differs from it (uncommitted changes)."""
    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(REPO), *argv], capture_output=True,
                                  text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "rollout_watchdog")
    return commit + (" + uncommitted changes in rollout_watchdog/" if dirty else "")


def bench_main(main: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> None:
    """Print the exact command line, arm the time limit, run `main`, exit with its status.

    SIGTERM is turned into KeyboardInterrupt so that every `with Fleet(...)` block unwinds and
    cleans up on Ctrl-C, on `kill`, on the time limit and on errors alike.
    """
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"cwd: {os.getcwd()}   host: {os.uname().nodename}   cpus: {os.cpu_count()}   "
          f"load: {load}   started: {time.strftime('%Y-%m-%d %H:%M:%S')}   "
          f"code: {code_version()}", flush=True)
    signal.signal(signal.SIGTERM, raise_interrupt)
    signal.signal(signal.SIGALRM, _raise_time_limit)
    signal.alarm(max(1, int(args.time_limit)))
    started = time.monotonic()
    try:
        status = main(args)
    except KeyboardInterrupt as exc:
        print(f"\ninterrupted ({str(exc) or 'Ctrl-C'}); cleaned up", file=sys.stderr)
        status = 130
    except TimeLimit:
        print(f"\nstopped: --time-limit {args.time_limit:g} s reached; cleaned up",
              file=sys.stderr)
        status = 124
    except Exception:
        traceback.print_exc()
        status = 1
    finally:
        signal.alarm(0)
    print(f"elapsed: {time.monotonic() - started:.0f} s", flush=True)
    sys.exit(status)


# ---------------------------------------------------------------------- figures

@dataclass
class Summary:
    name: str
    values: list[float]
    unit: str

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def p99(self) -> float:
        return percentile(self.values, 99)

    def line(self, digits: int = 1) -> str:
        if not self.values:
            return f"  {self.name:<44} no samples"
        f = f"{{:.{digits}f}}"
        return (f"  {self.name:<44} min {f.format(self.min)} / median {f.format(self.median)}"
                f" / max {f.format(self.max)} {self.unit}  (n={len(self.values)})")


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank percentile: the smallest value that `p` % of the values are at most
    (p99 of 100 values is the second largest; of 20 or fewer, the largest)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(p / 100 * len(ranked)) - 1)]


def summary(name: str, values: list[float], unit: str, digits: int = 1) -> Summary:
    """Print one `min / median / max` line and return the figures for goal checks."""
    s = Summary(name, list(values), unit)
    print(s.line(digits), flush=True)
    return s


def goal(text: str, ok: bool) -> bool:
    print(f"  goal {text}: {'MET' if ok else 'NOT MET'}", flush=True)
    return ok


# ---------------------------------------------------------------------- the daemon and engines

def engines(n: int, **extra: Any) -> list[EngineSpec]:
    """`n` emulator engines e0..e{n-1} on free ports; `extra` are other [[engine]] keys."""
    return [EngineSpec(f"e{i}", extra=dict(extra)) for i in range(n)]


class EventStream:
    """Follows the daemon's event stream (long poll on `events`) and keeps every event seen.

    Latencies are computed from the events' own `ts` (taken by the daemon when it decided), so
    how fast this follower happens to poll never enters a figure.
    """

    def __init__(self, node: Node) -> None:
        self.client = node.client
        self.next = 0
        self.boot: str | None = None
        self.seen: list[dict[str, Any]] = []

    def pull(self, wait_s: float = 0.0) -> list[dict[str, Any]]:
        result = self.client.call("events", {"since": self.next, "boot": self.boot,
                                             "wait_s": wait_s}, timeout_s=wait_s + 5.0)
        if self.boot is not None and result["boot"] != self.boot:
            raise RuntimeError("the daemon restarted during the benchmark")
        self.boot = result["boot"]
        self.next = result["next"]
        self.seen.extend(result["events"])
        return result["events"]

    def find(self, **match: Any) -> dict[str, Any] | None:
        for event in self.seen:
            if all(event.get(k) == v for k, v in match.items()):
                return event
        return None

    def wait(self, timeout: float, **match: Any) -> dict[str, Any]:
        """The first event (already seen or to come) whose fields equal `match`."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.find(**match)
            if found is not None:
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no event {match} within {timeout:g} s")
            self.pull(wait_s=min(remaining, 2.0))


class Fleet:
    """A real daemon (subprocess) over emulator engines, in a temporary directory.

    `close()` (also on Ctrl-C, SIGTERM, the time limit, errors) stops the daemon, then SIGKILLs
    every process that carries this run's marker, and waits for them to be gone.
    """

    def __init__(self, name: str, specs: list[EngineSpec], *, probe: dict[str, Any],
                 restart: dict[str, Any], env: dict[str, str] | None = None,
                 top: dict[str, Any] | None = None, keep: bool = False) -> None:
        self.token = uuid.uuid4().hex
        self.tmp = Path(tempfile.mkdtemp(prefix=f"rwbench-{name}-"))
        self.keep = keep
        self.node = Node(self.tmp, specs, probe=probe, restart=restart, top=top,
                         env={**(env or {}), MARKER_ENV: self.token})
        self.ids = [s.id for s in specs]
        self.events = EventStream(self.node)
        self.failed = False

    def __enter__(self) -> Fleet:
        try:
            self.node.start()
        except BaseException:
            self.failed = True
            with contextlib.suppress(OSError):
                tail = self.node.log_text().splitlines()[-15:]
                print("daemon log (last lines):\n  " + "\n  ".join(tail), file=sys.stderr)
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.failed = self.failed or exc_type is not None
        self.close()

    @property
    def daemon_pid(self) -> int:
        assert self.node.proc is not None
        return self.node.proc.pid

    def url(self, engine_id: str) -> str:
        return self.node.engines[engine_id].url

    def status(self) -> dict[str, dict[str, Any]]:
        return {e["id"]: e for e in self.node.status()["engines"]}

    def wait_all_healthy(self, timeout: float,
                         ids: list[str] | None = None) -> dict[str, dict[str, Any]]:
        """Every engine (of `ids`) healthy with deep probes active."""
        want = ids or self.ids

        def check() -> dict[str, dict[str, Any]] | None:
            engines = self.status()
            ok = all(engines[i]["state"] == "healthy" and not engines[i]["paused"] for i in want)
            return engines if ok else None
        return wait_for(check, timeout, f"{len(want)} engine(s) to be healthy", interval=0.1)

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             timeout_s: float = 10.0) -> Any:
        return self.node.client.call(cmd, args, timeout_s=timeout_s)

    def close(self) -> None:
        """Leave nothing behind; a second Ctrl-C during this bounded cleanup is ignored."""
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            proc = self.node.proc
            if proc is not None and proc.poll() is None:
                proc.terminate()  # the daemon stops every engine (SIGTERM, grace, SIGKILL)
                try:
                    proc.wait(timeout=15)
                except Exception:
                    proc.kill()
                    proc.wait(timeout=10)
            with contextlib.suppress(Exception):
                self.node.cleanup()
            left = kill_marked(self.token)
            if left:
                print(f"  (cleanup: SIGKILLed {left} leftover process(es))", flush=True)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if self.keep or self.failed:
            print(f"  (files kept in {self.tmp}: node.toml, daemon.log, state/logs/)", flush=True)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)


def marked(token: str) -> list[psutil.Process]:
    """Every live process whose environment carries this run's marker."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(MARKER_ENV) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue
    return found


def kill_marked(token: str) -> int:
    """SIGKILL every process that carries this run's marker; wait for them to be gone."""
    found = marked(token)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return len(found)


# ---------------------------------------------------------------------- kills

@dataclass
class KillRecord:
    """One abrupt kill and what the daemon made of it (events of the killed incarnation)."""

    target: str                    # "main" or "scheduler"
    pid: int
    incarnation: int
    killed_at: float               # epoch seconds, just before kill(2)
    exited_at: float               # epoch seconds, when our own pidfd on it became readable
    stopping: dict[str, Any]       # the event declaring the failure (to "stopping")

    @property
    def detection_s(self) -> float:
        return self.stopping["ts"] - self.killed_at

    @property
    def kernel_exit_s(self) -> float:
        """How long the kernel took to tear the process down (nobody can see it sooner)."""
        return self.exited_at - self.killed_at


def kill_and_follow(fleet: Fleet, engine_id: str, target: str,
                    timeout: float = 10.0) -> KillRecord:
    """SIGKILL the engine's main process or its scheduler child; return the failure event."""
    engine = fleet.status()[engine_id]
    incarnation = engine["incarnation"]
    if target == "main":
        pid = engine["pid"]
    elif target == "scheduler":
        pid = emulator_info(fleet.url(engine_id))["scheduler_pid"]
    else:
        raise ValueError(target)
    fleet.events.pull()  # drain what came before, so the wait below only looks forward
    pidfd = os.pidfd_open(pid)
    try:
        killed_at = time.time()
        os.kill(pid, signal.SIGKILL)
        select.select([pidfd], [], [], timeout)
        exited_at = time.time()
    finally:
        os.close(pidfd)
    stopping = fleet.events.wait(timeout, engine=engine_id, kind="state", to="stopping",
                                 incarnation=incarnation)
    return KillRecord(target, pid, incarnation, killed_at, exited_at, stopping)


@contextlib.contextmanager
def step(text: str) -> Iterator[None]:
    """Print what the benchmark is doing and how long it took (setup steps, not figures)."""
    print(f"- {text} ...", end="", flush=True)
    started = time.monotonic()
    yield
    print(f" {time.monotonic() - started:.1f} s", flush=True)
