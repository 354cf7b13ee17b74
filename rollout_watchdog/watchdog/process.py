"""Processes at the OS edge: launch an engine in its own session, identify processes safely
(pid plus create time, so a reused pid is never mistaken for ours), watch exits with pidfds,
walk process trees, send signals, and check that ports are free again."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rollout_watchdog.watchdog.cgroup import CgroupManager
from rollout_watchdog.watchdog.containment import read_marker

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PF_EXITING = 0x00000004   # the kernel has begun the process's exit
PF_KTHREAD = 0x00200000   # a kernel thread


@dataclass(frozen=True)
class ProcKey:
    """A process identity that survives pid reuse: the same pid with another start time is
    another process. `start_time` is the kernel's starttime, in seconds after boot: unlike a
    wall-clock create time it does not move when the clock is adjusted (within one boot; the
    state file records the boot id for the rest)."""

    pid: int
    start_time: float

    def to_json(self) -> list[float]:
        return [self.pid, self.start_time]

    @classmethod
    def from_json(cls, data: list[float]) -> ProcKey:
        return cls(int(data[0]), float(data[1]))


@dataclass(frozen=True)
class ProcStat:
    """The fields of /proc/PID/stat the watchdog needs."""

    pid: int
    state: bytes
    ppid: int
    pgrp: int
    start_time: float
    comm: str = ""          # the kernel's 15-character name (what PR_SET_NAME sets)
    flags: int = 0          # the kernel's PF_* flags

    @property
    def alive(self) -> bool:
        return self.state not in (b"Z", b"X")  # a zombie holds nothing and counts as dead

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)

    @property
    def key(self) -> ProcKey:
        return ProcKey(self.pid, self.start_time)


def read_stat(pid: int) -> ProcStat | None:
    """One read of /proc/PID/stat (cheaper than psutil by far: the daemon does this a lot);
    None if the process is gone. Any other error (no file descriptor left, say) is raised: an
    exit is never inferred from an error."""
    try:  # os-level calls: a Python file object costs more than the read itself
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        data = os.read(fd, 4096)
    except ProcessLookupError:
        return None
    finally:
        os.close(fd)
    try:
        # after "pid (comm)": state, ppid, pgrp, ..., starttime is the 20th
        head, tail = data.rsplit(b")", 1)
        fields = tail.split()
        return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]),
                        int(fields[19]) / CLOCK_TICKS,
                        head.split(b"(", 1)[1].decode(errors="replace"), int(fields[6]))
    except (IndexError, ValueError):
        return None  # an empty read: the process went away while we read


def process_table() -> dict[int, ProcStat]:
    """Every process on the host, from one scan of /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                stat = read_stat(int(name))
            except PermissionError:
                continue
            if stat is not None:
                table[stat.pid] = stat
    return table


def has_exited(key: ProcKey) -> bool:
    """Gone, a zombie, or on its way out: PF_EXITING is set before the kernel closes the
    process's sockets, and its pidfd becomes readable only after. A probe that fails in
    between (connection reset) says nothing the exit will not say better."""
    stat = read_stat(key.pid)
    return (stat is None or stat.start_time != key.start_time or not stat.alive
            or bool(stat.flags & PF_EXITING))


def proc_key(pid: int) -> ProcKey | None:
    """The identity of a pid that exists (a zombie included), or None if it is gone."""
    stat = read_stat(pid)
    return stat.key if stat else None


def is_alive(key: ProcKey) -> bool:
    """Still running, and still the same process. A zombie counts as dead."""
    stat = read_stat(key.pid)
    return stat is not None and stat.start_time == key.start_time and stat.alive


def launch(command: Sequence[str], env: Mapping[str, str], output: int,
           cwd: str | None = None) -> subprocess.Popen[bytes]:
    """Start an engine in a new session (so its whole group can be signalled, and a daemon
    crash does not take it down), with stdout and stderr on the `output` descriptor."""
    return subprocess.Popen(list(command), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                            stdout=output, stderr=output, start_new_session=True,
                            close_fds=True)


def open_pidfd(key: ProcKey) -> int | None:
    """A pidfd on the process, which becomes readable when it exits (zombie included), or None
    if the process is already gone or the pid now belongs to someone else. OSError when a pidfd
    cannot be had (no file descriptor left): the process must then be watched another way."""
    try:
        fd = os.pidfd_open(key.pid)
    except ProcessLookupError:
        return None
    # The pidfd pins the pid: if the create time still matches now, the fd is for our process.
    if not is_alive(key):
        os.close(fd)
        return None
    return fd


def descendants(roots: Iterable[int], table: dict[int, ProcStat] | None = None
                ) -> dict[int, list[ProcKey]]:
    """Every live descendant of each root pid, from one scan of the process table."""
    table = process_table() if table is None else table
    children: dict[int, list[ProcStat]] = {}
    for stat in table.values():
        children.setdefault(stat.ppid, []).append(stat)
    found: dict[int, list[ProcKey]] = {}
    for root in roots:
        out: list[ProcKey] = []
        stack = list(children.get(root, ()))
        seen = set()
        while stack:
            stat = stack.pop()
            if stat.pid in seen:
                continue
            seen.add(stat.pid)
            if stat.alive:
                out.append(stat.key)
            stack.extend(children.get(stat.pid, ()))
        found[root] = out
    return found


def signal_proc(key: ProcKey, sig: int) -> bool:
    """Signal one process if it is still the one we know; True if the signal was sent. Through
    a pidfd opened before the identity check, so that a pid taken by another process in
    between is never signalled (kill() after the check could hit it); with no descriptor
    left, the check and kill()."""
    try:
        fd = open_pidfd(key)
    except OSError:
        fd = -1
    if fd is None:
        return False
    try:
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        elif is_alive(key):
            os.kill(key.pid, sig)
        else:
            return False
        return True
    except ProcessLookupError:
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def signal_group(pgid: int, sig: int) -> bool:
    """Signal a whole process group; True if any member was there to receive it. Never group
    0 or 1 (killpg(1) is kill(-1): every process) nor the daemon's own group."""
    if pgid <= 1 or pgid == os.getpgrp():
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return False


def live_process_groups(table: dict[int, ProcStat] | None = None) -> set[int]:
    """Process groups with at least one live member. Zombies do not count: they wait for a
    reaper that may be slow (or absent: a container whose PID 1 does not reap)."""
    table = process_table() if table is None else table
    return {stat.pgrp for stat in table.values() if stat.alive}


def process_group(key: ProcKey) -> int | None:
    """The process group of a live process we know, or None."""
    stat = read_stat(key.pid)
    if stat is None or not stat.alive or stat.start_time != key.start_time:
        return None
    return stat.pgrp


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


def peek_exit(pid: int) -> int | None:
    """The exit status of our exited child without reaping it (Popen's convention: negative
    for a signal), or None if it has not exited or is not our child."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return None
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def exit_fields(returncode: int | None) -> dict[str, int | str]:
    """The exit as an event's fields: `exit_code`, or `exit_signal` (its name); none when
    unknown (an adopted engine's)."""
    if returncode is None:
        return {}
    if returncode < 0:
        try:
            return {"exit_signal": signal.Signals(-returncode).name}
        except ValueError:
            return {"exit_signal": str(-returncode)}
    return {"exit_code": returncode}


def describe_exit(returncode: int | None) -> str:
    """'exit code 3', 'killed by SIGKILL', or 'exit status unknown' (adopted engines): the
    words for exit_fields."""
    fields = exit_fields(returncode)
    if "exit_code" in fields:
        return f"exit code {fields['exit_code']}"
    if "exit_signal" in fields:
        name = str(fields["exit_signal"])
        return f"killed by {'signal ' if name.isdigit() else ''}{name}"
    return "exit status unknown"


def is_kernel_thread(pid: int) -> bool:
    """A kernel thread (kthreadd and its children): never an engine, and never signalled."""
    try:
        stat = read_stat(pid)
    except OSError:
        return False
    return stat is not None and stat.kernel_thread


class ProcessOps:
    """Every process operation of the supervisor goes through one of these (supervisor's
    `options` object), so tests can drive the whole core with a double."""

    read_stat = staticmethod(read_stat)
    process_table = staticmethod(process_table)
    proc_key = staticmethod(proc_key)
    is_alive = staticmethod(is_alive)
    has_exited = staticmethod(has_exited)
    launch = staticmethod(launch)
    open_pidfd = staticmethod(open_pidfd)
    descendants = staticmethod(descendants)
    signal_proc = staticmethod(signal_proc)
    signal_group = staticmethod(signal_group)
    live_process_groups = staticmethod(live_process_groups)
    process_group = staticmethod(process_group)
    port_bindable = staticmethod(port_bindable)
    peek_exit = staticmethod(peek_exit)
    is_kernel_thread = staticmethod(is_kernel_thread)
    cgroup_kill = staticmethod(CgroupManager.kill)
    cgroup_populated = staticmethod(CgroupManager.populated)
    cgroup_remove = staticmethod(CgroupManager.remove)
    read_marker = staticmethod(read_marker)
