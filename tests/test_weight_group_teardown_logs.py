"""A group's teardown logs what is news (issue 13 §4.8): a live member that does not answer at
INFO; an expected refusal (its group already gone, as on a relaunched incarnation) and a dead
incarnation's refused connection at DEBUG only. Real peers over gloo (tests/test_weight_group.py's).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import urllib.request
from collections.abc import Callable

import pytest

pytest.importorskip("torch")
from test_weight_group import Peer, _group, peers  # noqa: E402, F401 - `peers` is a fixture

GROUP_LOG = "rollout_watchdog.refit_bridge.group"


def test_refusals_and_the_dead_at_teardown_are_debug_and_silence_is_info(
        peers: Callable[..., list[Peer]],  # noqa: F811 - the fixture imported above
        caplog: pytest.LogCaptureFixture) -> None:
    refusing, dead, stopped = peers("none", "none", "none")
    group = _group([refusing, dead, stopped])
    group.build()
    request = urllib.request.Request(
        refusing.url + "/destroy_weights_update_group", method="POST",
        data=json.dumps({"group_name": group.group_name}).encode(),
        headers={"Content-Type": "application/json"})
    urllib.request.urlopen(request, timeout=10).close()   # its side is gone: destroy says 400
    dead.kill()
    os.kill(stopped.proc.pid, signal.SIGSTOP)   # alive, connections accepted, never answered
    try:
        with caplog.at_level(logging.DEBUG, logger=GROUP_LOG):
            group.destroy(wait_s=3.0)
    finally:
        os.kill(stopped.proc.pid, signal.SIGCONT)
    about = {m.url: [r for r in caplog.records if r.name == GROUP_LOG
                     and r.getMessage().startswith(f"destroy_weights_update_group at {m.label()}")]
             for m in group.members}
    assert [r.levelno for r in about[refusing.url]] == [logging.DEBUG], about
    assert "does not exist" in about[refusing.url][0].getMessage()
    assert [r.levelno for r in about[dead.url]] == [logging.DEBUG], about
    assert [r.levelno for r in about[stopped.url]] == [logging.INFO], about
