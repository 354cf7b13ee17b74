"""Containment at the OS edge: what keeps every process of an engine incarnation findable.

- The daemon becomes a child subreaper, so that a process that daemonized (double fork plus
  ``setsid``) re-parents to the daemon instead of init, and the daemon reaps it.
- Every engine's environment carries a marker naming the node, the engine and the incarnation;
  every descendant inherits it, so a process found anywhere can be attributed exactly, even after
  it changed its session or its name.
- The soft open-file limit goes up to the hard one at start (`common.limits`), so that a pidfd
  per watched process cannot run the daemon out of descriptors.

Plain functions, no daemon knowledge: the daemon decides when to call them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

PR_SET_CHILD_SUBREAPER = 36
MARKER_ENV = "ROLLOUT_WATCHDOG_ENGINE"
# /proc/PID/environ is read at most this far: ARG_MAX bounds it anyway, but a scan of the whole
# host must not copy megabytes per process. with_marker puts the marker first, so it is found in
# the first bytes of every engine process (unless the process rewrote its own environ).
ENVIRON_READ_LIMIT = 256 * 1024
_SEP = "/"


class Marker(NamedTuple):
    """The parsed marker: which launch of which engine on which node a process belongs to."""

    node_id: str
    engine_id: str
    incarnation: int
    boot: str


def set_child_subreaper(on: bool = True) -> bool:
    """Make orphaned descendants re-parent to this process (Linux >= 3.4), or stop doing so;
    False if refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _children() -> set[int]:
    """Every child of this process, from the children lists of all its threads: an orphan
    re-parents to any live thread of the subreaper."""
    found: set[int] = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found.update(int(pid) for pid in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def _reap(pid: int) -> tuple[int, int] | None:
    """Reap ``pid`` if it has exited: (pid, Popen-style status: negative for a signal)."""
    try:
        reaped, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    if reaped == 0:
        return None
    return reaped, os.waitstatus_to_exitcode(status)


def reap_children(keep: Iterable[int]) -> list[tuple[int, int]]:
    """Reap every exited child of this process whose pid is not in ``keep``, so that orphans
    re-parented to the daemon never stay zombies. Returns (pid, status) for each, the status in
    Popen's convention (negative for a signal).

    ``keep`` must hold every child whose exit status someone still wants: the engines' main
    processes (peeked with WNOWAIT), and any child a Popen or subprocess.run still waits on.
    Those are never reaped here.
    """
    keep = set(keep)
    reaped: list[tuple[int, int]] = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped  # no children at all
        if info is None:
            return reaped  # children, none exited
        if info.si_pid in keep:
            break
        if (done := _reap(info.si_pid)) is not None:
            reaped.append(done)
    # waitid(P_ALL) keeps answering with the same kept zombie, which hides the others behind
    # it: try each child by pid instead (WNOHANG on a live one is a no-op).
    for pid in sorted(_children() - keep):
        if (done := _reap(pid)) is not None:
            reaped.append(done)
    return reaped


def marker_value(node_id: str, engine_id: str, incarnation: int, boot: str) -> str:
    """The marker of one engine incarnation: "node/engine/incarnation/boot". ``boot`` tells two
    launches of the same incarnation apart (a daemon that died between launch and save)."""
    if not node_id or "\0" in node_id:
        raise ValueError(f"marker: unusable node id {node_id!r}")
    for name, value in (("engine id", engine_id), ("boot token", boot)):
        if not value or _SEP in value or "\0" in value:
            raise ValueError(f"marker: {name} {value!r} must be non-empty, without '/' or NUL")
    if incarnation < 0:
        raise ValueError(f"marker: incarnation {incarnation} is negative")
    return _SEP.join((node_id, engine_id, str(incarnation), boot))


def state_tag(state_dir: Path) -> str:
    """The state dir's tag: it tells two daemons on one host apart (each adopts, and kills,
    only what its state dir launched), in the node part of the markers and in cgroup names."""
    return hashlib.sha1(str(state_dir.resolve()).encode()).hexdigest()[:8]


def marker_node(node_id: str, state_dir: Path) -> str:
    """The node part of the markers of the engines that the daemon of `state_dir` launches."""
    return f"{node_id}:{state_tag(state_dir)}"


def marker_prefix(node_id: str, engine_id: str | None = None) -> str:
    """The prefix matching every marker of a node, or of one engine of it."""
    return _SEP.join((node_id, engine_id, "")) if engine_id else node_id + _SEP


def parse_marker(value: str) -> Marker | None:
    """The parts of a marker, or None if ``value`` is not one. The node id may hold '/'; the
    other parts cannot, so the split is from the right."""
    parts = value.rsplit(_SEP, 3)
    if len(parts) != 4 or not all(parts) or not parts[2].isdigit():
        return None
    return Marker(parts[0], parts[1], int(parts[2]), parts[3])


def with_marker(env: Mapping[str, str], value: str) -> dict[str, str]:
    """``env`` with the marker set, first: read_marker then finds it within the first bytes."""
    out = {MARKER_ENV: value}
    out.update((k, v) for k, v in env.items() if k != MARKER_ENV)
    return out


def read_marker(pid: int) -> str | None:
    """The marker in /proc/PID/environ; None where there is none, or the process cannot be
    read (EACCES) or is gone. The read stops at ENVIRON_READ_LIMIT bytes.

    "" where the environment reads empty, which says nothing yet: a kernel thread has none,
    and a process in the middle of an exec reads empty until the kernel has laid out the new
    one. That window is open even after ``Popen`` has returned (the exec closes Popen's pipe
    first): 1 read in 7 right after a Popen here, 5 in 6 under load. Look again later."""
    needle = MARKER_ENV.encode() + b"="
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            data = f.read(ENVIRON_READ_LIMIT)
    except OSError:
        return None
    if not data:
        return ""
    for entry in data.split(b"\0"):
        if entry.startswith(needle):
            return entry[len(needle):].decode("utf-8", "replace")
    return None
