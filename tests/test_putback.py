"""refit_bridge.putback: the members of a refit whose holder vanished are put back in service
off the loop; those that cannot be are named in one warning, not one line each (a fleet has
thousands)."""

from __future__ import annotations

import logging
import socket

import pytest
from daemon_harness import wait_for

from rollout_watchdog.refit_bridge.putback import SHOWN_ERRORS, PutBack


def test_members_that_cannot_be_put_back_are_named_in_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    ports = []
    for _ in range(SHOWN_ERRORS + 3):   # nothing listens on them
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    caplog.set_level(logging.WARNING, logger="rollout_watchdog.refit_bridge.putback")
    putback = PutBack("refit #7", [f"http://127.0.0.1:{port}" for port in ports], call_s=2.0)
    wait_for(putback.done, 30, "the put-back")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"refit #7: {len(ports)} member(s) not put back in service")
    assert warnings[0].endswith("; and 3 more")
