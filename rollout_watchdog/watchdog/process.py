"""Processes at the OS edge: launch an engine in its own session, identify processes safely
(pid plus create time, so a reused pid is never mistaken for ours), watch exits with pidfds,
walk process trees, send signals, and check that ports are free again."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ProcKey:
    """A process identity that survives pid reuse: the same pid with another create time is
    another process."""

    pid: int
    create_time: float

    def to_json(self) -> list[float]:
        return [self.pid, self.create_time]

    @classmethod
    def from_json(cls, data: list[float]) -> ProcKey:
        return cls(int(data[0]), float(data[1]))


def proc_key(pid: int) -> ProcKey | None:
    """The identity of a live pid, or None if it is gone."""
    try:
        return ProcKey(pid, psutil.Process(pid).create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def is_alive(key: ProcKey) -> bool:
    """Still running, and still the same process. A zombie counts as dead."""
    try:
        proc = psutil.Process(key.pid)
        return (proc.create_time() == key.create_time
                and proc.status() != psutil.STATUS_ZOMBIE)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def launch(command: tuple[str, ...], env: Mapping[str, str], log_path: Path,
           cwd: str | None = None) -> subprocess.Popen[bytes]:
    """Start an engine in a new session (so its whole group can be signalled, and a daemon
    crash does not take it down), with output appended to its log file."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(list(command), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                close_fds=True)


def open_pidfd(key: ProcKey) -> int | None:
    """A pidfd on the process, which becomes readable when it exits (zombie included), or None
    if the process is already gone or the pid now belongs to someone else."""
    try:
        fd = os.pidfd_open(key.pid)
    except ProcessLookupError:
        return None
    # The pidfd pins the pid: if the create time still matches now, the fd is for our process.
    if not is_alive(key):
        os.close(fd)
        return None
    return fd


def descendants(roots: Iterable[int]) -> dict[int, list[ProcKey]]:
    """Every live descendant of each root pid, from one scan of the process table."""
    children: dict[int, list[int]] = {}
    created: dict[int, float] = {}
    for proc in psutil.process_iter(["ppid", "create_time"]):
        info = proc.info
        if info["ppid"] is None or info["create_time"] is None:
            continue
        children.setdefault(info["ppid"], []).append(proc.pid)
        created[proc.pid] = info["create_time"]
    found: dict[int, list[ProcKey]] = {}
    for root in roots:
        out: list[ProcKey] = []
        stack = list(children.get(root, ()))
        seen = set()
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            out.append(ProcKey(pid, created[pid]))
            stack.extend(children.get(pid, ()))
        found[root] = out
    return found


def signal_proc(key: ProcKey, sig: int) -> bool:
    """Signal one process if it is still the one we know; True if the signal was sent."""
    if not is_alive(key):
        return False
    try:
        os.kill(key.pid, sig)
        return True
    except ProcessLookupError:
        return False


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; True if any member was there to receive it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def live_process_groups() -> set[int]:
    """Process groups with at least one live member, from one scan of /proc. Zombies do not
    count: they wait for a reaper that may be slow (or absent: a container whose PID 1 does not
    reap), and hold nothing."""
    groups = set()
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # after the command: state, ppid, pgrp
        if fields[0] not in (b"Z", b"X"):
            groups.add(int(fields[2]))
    return groups


def group_alive(pgid: int) -> bool:
    """Is any live process left in the group?"""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return pgid in live_process_groups()


def process_group(key: ProcKey) -> int | None:
    """The process group of a live process we know, or None."""
    try:
        pgid = os.getpgid(key.pid)
    except ProcessLookupError:
        return None
    return pgid if is_alive(key) else None


def stop_signal_group(pgid: int) -> None:
    """SIGTERM preceded by SIGCONT, so a stopped (SIGSTOPped, traced) process receives it."""
    signal_group(pgid, signal.SIGCONT)
    signal_group(pgid, signal.SIGTERM)


def port_bindable(port: int) -> bool:
    """Could an engine bind this TCP port now (as servers do, with SO_REUSEADDR)?"""
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((addr, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            # Anything else (no IPv6, a privileged port for a non-root daemon): this check
            # cannot tell, and must not block a relaunch on its own account.
            continue
        finally:
            sock.close()
    return True


def describe_exit(returncode: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL', or 'exit status unknown' (adopted engines)."""
    if returncode is None:
        return "exit status unknown"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
