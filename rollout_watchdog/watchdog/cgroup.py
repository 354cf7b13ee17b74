"""cgroup v2, one cgroup per engine incarnation, where the daemon's cgroup is delegated to it
(systemd ``Delegate=yes``). This is how systemd itself knows that a unit is empty: the kernel
keeps every descendant of an engine in its cgroup whatever it does (double fork, ``setsid``,
a new name), ``cgroup.kill`` SIGKILLs all of them at once, and ``cgroup.events`` says
``populated 0`` when the last one is gone.

Layout under the delegated root (the daemon's own cgroup when it starts)::

    ROOT/daemon              the daemon itself (cgroup v2 allows processes in leaves only,
                             once controllers are enabled: the "no internal processes" rule)
    ROOT/engine-ID-INC-TOKEN-OWNER   one per engine incarnation: TOKEN the launching daemon's
                             boot, OWNER its state dir's tag (two daemons may share a root:
                             each kills only the leftovers of its own state dir)

Where no delegated cgroup v2 is usable (containers, tests, cgroup v1), the daemon falls back to
the subreaper and the environment marker (containment.py): ``mode_of`` names the mode in force.

An engine starts inside its cgroup through a tiny ``/bin/sh`` shim that writes its own pid to
``cgroup.procs`` and then execs the engine's command: the same pid, so Popen and the pidfd
still watch the engine, and nothing of the engine runs before the move (no race with an early
fork, unlike a move after Popen returns; and no Python code between fork and exec in a threaded
daemon, unlike a ``preexec_fn``).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

MODE_CGROUP = "cgroup"
MODE_SUBREAPER = "subreaper"
DAEMON_LEAF = "daemon"
ENGINE_PREFIX = "engine-"
_SHIM = 'echo $$ > "$1" || exit 125; shift; exec "$@"'
_SHIM_NAME = "rollout-watchdog-cgroup-join"


class CgroupError(Exception):
    """A cgroup operation failed in a way that says nothing about the engine's processes."""


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def cgroup2_mount(mountinfo: str) -> tuple[Path, str] | None:
    """(mount point, root within the hierarchy) of the cgroup2 mount, /sys/fs/cgroup first
    (unified layout), else any (the hybrid layout mounts it at /sys/fs/cgroup/unified)."""
    found: list[tuple[Path, str]] = []
    for line in mountinfo.splitlines():
        fields, sep, rest = line.partition(" - ")
        parts = fields.split()
        if sep and rest.split()[:1] == ["cgroup2"] and len(parts) >= 5:
            found.append((Path(_unescape(parts[4])), _unescape(parts[3])))
    found.sort(key=lambda m: m[0] != Path("/sys/fs/cgroup"))
    return found[0] if found else None


def own_cgroup(proc_cgroup: str) -> str | None:
    """The cgroup v2 path of a process from its /proc/PID/cgroup text ("0::/path")."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def cgroup_dir(mount: Path, mount_root: str, path: str) -> Path | None:
    """The directory of cgroup ``path`` under a mount of the hierarchy at ``mount_root``."""
    root = mount_root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None  # our cgroup is outside what this mount shows
    return mount / path[len(root):].lstrip("/")


def probe_delegated_root() -> tuple[Path | None, str]:
    """(the delegated root, "") or (None, why not): the reason goes to the log and status."""
    try:
        mount = cgroup2_mount(Path("/proc/self/mountinfo").read_text())
        rel = own_cgroup(Path("/proc/self/cgroup").read_text())
    except OSError as exc:
        return None, f"cannot read /proc/self: {exc}"
    if mount is None:
        return None, "no cgroup2 file system is mounted"
    if rel is None:
        return None, "this process has no cgroup v2 path (cgroup v1 only)"
    root = cgroup_dir(*mount, rel)
    if root is None:
        return None, f"our cgroup {rel} is not visible under {mount[0]}"
    if root.name == DAEMON_LEAF:
        root = root.parent  # a daemon restarted in this process already moved to its leaf
    if not (root / "cgroup.kill").exists():
        return None, f"{root} has no cgroup.kill (the root cgroup, or a kernel before 5.14)"
    if not os.access(root, os.W_OK) or not os.access(root / "cgroup.procs", os.W_OK):
        return None, f"{root} is not writable by us (not delegated: Delegate=yes)"
    probe = root / f".probe-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as exc:
        return None, f"cannot create a cgroup under {root}: {exc.strerror}"
    return root, ""


def detect_delegated_root() -> Path | None:
    """The daemon's own cgroup, if it is delegated to us and cgroup v2 can contain engines."""
    return probe_delegated_root()[0]


def _write(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _subtree(path: Path) -> list[Path]:
    """``path`` and every cgroup below it, deepest first (an engine may make its own)."""
    found = [Path(d) for d, _, _ in os.walk(path)]
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


class CgroupManager:
    """The engine cgroups under one delegated root."""

    mode = MODE_CGROUP

    def __init__(self, root: Path, owner: str) -> None:
        if not owner or "/" in owner or "-" in owner:
            raise ValueError(f"cgroup owner {owner!r} must be non-empty, without '/' or '-'")
        self.root = root
        self.owner = owner   # the state dir's tag: which engine cgroups under root are ours

    @classmethod
    def detect(cls, owner: str) -> CgroupManager | None:
        """A manager for the delegated root, or None: the subreaper fallback is then in force."""
        root = detect_delegated_root()
        return cls(root, owner) if root is not None else None

    def prepare(self) -> None:
        """Move this process into ROOT/daemon, so that engine cgroups can sit beside it."""
        leaf = self.root / DAEMON_LEAF
        try:
            leaf.mkdir(exist_ok=True)
            _write(leaf / "cgroup.procs", str(os.getpid()))
        except OSError as exc:
            raise CgroupError(f"cannot move the daemon into {leaf}: {exc.strerror}") from exc

    def path(self, engine_id: str, incarnation: int, token: str) -> Path:
        """Where this launch's cgroup is: named by engine, incarnation and the launching
        daemon's token and owner, so that two daemons' launches never share one."""
        return self.root / f"{ENGINE_PREFIX}{engine_id}-{incarnation}-{token}-{self.owner}"

    def create(self, engine_id: str, incarnation: int, token: str) -> Path:
        """The empty cgroup for this launch (CgroupError if it already holds processes)."""
        path = self.path(engine_id, incarnation, token)
        try:
            path.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupError(f"cannot create {path}: {exc.strerror}") from exc
        if self.populated(path):
            raise CgroupError(f"{path} already holds processes: {self.pids(path)}")
        return path

    def existing(self) -> list[Path]:
        """Every engine cgroup of this owner under the root: after a daemon restart, those of
        adopted engines and of copies that were never recorded. Another daemon's under the
        same root (two daemons in one delegated cgroup) are not ours to clean, nor to kill."""
        try:
            entries = list(os.scandir(self.root))
        except OSError as exc:
            raise CgroupError(f"cannot list {self.root}: {exc.strerror}") from exc
        return [Path(e.path) for e in entries if e.name.startswith(ENGINE_PREFIX)
                and e.name.endswith(f"-{self.owner}") and e.is_dir()]

    @staticmethod
    def command(path: Path, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
        """``argv`` wrapped so that the process joins cgroup ``path`` before the command runs.

        A command that cannot be found raises FileNotFoundError here, as Popen would without the
        shim (which would otherwise start and exit 127)."""
        if not argv:
            raise ValueError("empty command")
        if os.sep not in argv[0]:
            search = os.pathsep.join(os.get_exec_path(env))
            if shutil.which(argv[0], path=search) is None:
                raise FileNotFoundError(errno.ENOENT, "command not found", argv[0])
        return ["/bin/sh", "-c", _SHIM, _SHIM_NAME, str(path / "cgroup.procs"), *argv]

    @staticmethod
    def kill(path: Path) -> bool:
        """SIGKILL every process in the cgroup and below it, at once (Linux >= 5.14). False if the
        kernel refused or the cgroup is gone: the caller then signals the pids it knows."""
        try:
            _write(path / "cgroup.kill", "1")
        except OSError:
            return False
        return True

    @staticmethod
    def populated(path: Path) -> bool:
        """Whether any process is left in the cgroup or below it. A cgroup that does not exist
        holds none (the kernel refuses to remove a populated one); other errors raise."""
        try:
            events = (path / "cgroup.events").read_text()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise CgroupError(f"cannot read {path}/cgroup.events: {exc.strerror}") from exc
        for line in events.splitlines():
            key, _, value = line.partition(" ")
            if key == "populated":
                return value.strip() == "1"
        raise CgroupError(f"{path}/cgroup.events has no 'populated' line")

    @staticmethod
    def pids(path: Path) -> list[int]:
        """Every process in the cgroup and below it (empty if the cgroup is gone)."""
        found: list[int] = []
        for cgroup in _subtree(path):
            try:
                found.extend(int(p) for p in (cgroup / "cgroup.procs").read_text().split())
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:
                raise CgroupError(f"cannot read {cgroup}/cgroup.procs: {exc}") from exc
        return sorted(found)

    @staticmethod
    def remove(path: Path) -> bool:
        """Remove the cgroup and any below it; False if a process is still in it (EBUSY)."""
        for cgroup in _subtree(path):
            try:
                cgroup.rmdir()
            except FileNotFoundError:
                continue
            except OSError:
                return False
        return True


def mode_of(manager: CgroupManager | None) -> str:
    """The containment mode for status: "cgroup" or "subreaper"."""
    return manager.mode if manager is not None else MODE_SUBREAPER
