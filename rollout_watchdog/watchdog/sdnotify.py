"""A dependency-free sd_notify client.

systemd's notify protocol is one datagram per message on the AF_UNIX socket named by
``NOTIFY_SOCKET``, holding newline-separated ``KEY=VALUE`` assignments. The daemon calls this from
its main loop, so a send never blocks (the socket is non-blocking) and never raises: a missing or
full socket must not take the supervisor of every engine on the node down with it.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)


class SystemdNotifier:
    """Sends readiness, status and watchdog keep-alives to systemd, or nothing when not under it."""

    def __init__(self, socket_path: str | None = None) -> None:
        """Use ``socket_path``, else ``$NOTIFY_SOCKET``; without either every call is a no-op.

        A leading ``@`` names a socket in the abstract namespace (systemd's own convention).
        """
        path = os.environ.get("NOTIFY_SOCKET") if socket_path is None else socket_path
        self._address: str | None = None
        if path:
            self._address = "\0" + path[1:] if path.startswith("@") else path
        self._sock: socket.socket | None = None
        self._failing = False
        self.errors = 0  # messages that could not be sent, for diagnostics

    @property
    def enabled(self) -> bool:
        """Whether a notify socket is configured at all."""
        return self._address is not None

    def send(self, message: str) -> bool:
        """Send one datagram; return whether it left. Failures are counted, each run logged once."""
        if self._address is None:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC
                )
            self._sock.sendto(message.encode("utf-8", "replace"), self._address)
        except OSError as exc:
            self.errors += 1
            if not self._failing:
                self._failing = True
                log.warning("sd_notify to %r failed: %s", self._address.replace("\0", "@"), exc)
            return False
        if self._failing:
            self._failing = False
            log.info("sd_notify works again after %d failed message(s)", self.errors)
        return True

    def notify(self, **fields: str) -> bool:
        """Send ``KEY=VALUE`` fields in one datagram, e.g. ``notify(READY="1", STATUS="up")``.

        Newlines in values would start a new assignment, so they are flattened to spaces.
        """
        lines = (f"{key}={' '.join(str(value).splitlines())}" for key, value in fields.items())
        return self.send("\n".join(lines))

    def ready(self) -> bool:
        """Tell systemd that start-up is complete (Type=notify waits for this)."""
        return self.notify(READY="1")

    def stopping(self) -> bool:
        """Tell systemd that an orderly shutdown has begun."""
        return self.notify(STOPPING="1")

    def status(self, text: str) -> bool:
        """Set the one-line status shown by ``systemctl status``."""
        return self.notify(STATUS=text)

    def watchdog(self) -> bool:
        """Keep-alive: send it only from a live main loop, so that a hung loop gets restarted."""
        return self.notify(WATCHDOG="1")

    def watchdog_interval_s(self) -> float | None:
        """How often to call :meth:`watchdog`: half of ``$WATCHDOG_USEC``, as sd_watchdog_enabled.

        None when no watchdog is set, or when ``$WATCHDOG_PID`` names another process (the
        variables were inherited, so the keep-alives are not expected from us).
        """
        usec = os.environ.get("WATCHDOG_USEC")
        pid = os.environ.get("WATCHDOG_PID")
        if not usec or (pid and pid != str(os.getpid())):
            return None
        try:
            value = int(usec)
        except ValueError:
            return None
        return value / 2e6 if value > 0 else None

    def close(self) -> None:
        """Release the socket; a later send opens a new one."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
