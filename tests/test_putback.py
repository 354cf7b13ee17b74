"""refit_bridge.putback: the members of a refit whose holder vanished are put back in service
off the loop; those that cannot be are named in one warning, not one line each (a fleet has
thousands)."""

from __future__ import annotations

import logging
import socket

import pytest
from daemon_harness import wait_for

from rollout_watchdog.refit_bridge import putback as putback_module
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


def test_a_put_back_the_process_ending_cuts_short_is_said_not_raised(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease that ends as the coordinator's process exits: the put-back's thread can start no
    thread of its own any more (ThreadPoolExecutor refuses, as at interpreter shutdown). It
    says so in one warning and ends, where a traceback was printed."""
    def refused(urls: list[str], action: object) -> dict[str, str]:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")
    monkeypatch.setattr(putback_module.engine_calls, "on_each", refused)
    caplog.set_level(logging.WARNING, logger="rollout_watchdog.refit_bridge.putback")
    putback = PutBack("refit #8", ["http://127.0.0.1:9"], call_s=2.0)
    wait_for(putback.done, 10, "the put-back")
    assert [r.getMessage() for r in caplog.records] == [
        "refit #8: the process is ending: 1 member(s) not put back in service"]
