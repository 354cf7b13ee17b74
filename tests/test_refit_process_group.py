"""init_custom_process_group: real processes meet at one TCPStore and broadcast from rank 0."""

from __future__ import annotations

import datetime
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_watchdog.common.torch_group import (
    _backend_options_kwarg,
    _sglang_helper,
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)
from rollout_watchdog.emulator.testing import free_port

torch = pytest.importorskip("torch")

# A member (rank >= 1): join, receive one tensor from rank 0, print it, tear down.
MEMBER = """
import datetime, sys, torch
from rollout_watchdog.common.torch_group import (
    destroy_process_group, init_custom_process_group)
init, rank, world, name = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
pg = init_custom_process_group("gloo", init, datetime.timedelta(seconds=30), world, rank, name)
buf = torch.zeros(4)
torch.distributed.broadcast(buf, src=0, group=pg)
print(rank, pg.rank(), pg.size(), buf.tolist(), flush=True)
destroy_process_group(pg)
"""


def test_members_and_rank0_broadcast() -> None:
    """Rank 0 (here) and two member processes build one group; every member gets the tensor."""
    init = f"tcp://127.0.0.1:{free_port()}"
    world, name = 3, "weight_update_group"
    members = [
        subprocess.Popen(
            [sys.executable, "-c", MEMBER, init, str(rank), str(world), name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank in (1, 2)
    ]
    try:
        pg = init_custom_process_group(
            "gloo", init, datetime.timedelta(seconds=30), world, 0, name
        )
        assert (pg.rank(), pg.size()) == (0, world)
        torch.distributed.broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0]), src=0, group=pg)
        outputs = [m.communicate(timeout=60) for m in members]
        destroy_process_group(pg)
    finally:
        for m in members:
            m.kill()
            m.wait()
    for rank, (out, err) in zip((1, 2), outputs, strict=True):
        assert out.strip() == f"{rank} {rank} {world} [1.0, 2.0, 3.0, 4.0]", err


def test_group_name_is_free_again_after_destroy() -> None:
    """A destroyed group's name can be reused (a refit builds a new group with the same name)."""
    for _ in range(2):
        pg = init_custom_process_group(
            "gloo", f"tcp://127.0.0.1:{free_port()}", datetime.timedelta(seconds=10), 1, 0, "g"
        )
        destroy_process_group(pg)
    destroy_process_group(pg)  # twice is harmless
    destroy_process_group(None)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="group_name"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", None, 2, 0, "")
    with pytest.raises(ValueError, match="rank 2 is not in a group of world_size 2"):
        init_custom_process_group("gloo", "tcp://127.0.0.1:1", None, 2, 2, "g")


def test_backend_options_kwarg_follows_torch_rename() -> None:
    assert _backend_options_kwarg("2.13.0+cpu") == "backend_options"
    assert _backend_options_kwarg("2.5.1") == "pg_options"
    assert _backend_options_kwarg("2.10.0") == "backend_options"


def test_tcp_init_method_brackets_ipv6_once() -> None:
    assert tcp_init_method("10.0.0.1", 29500) == "tcp://10.0.0.1:29500"
    assert tcp_init_method("fe80::1", 29500) == "tcp://[fe80::1]:29500"
    assert tcp_init_method("[fe80::1]", 29500) == "tcp://[fe80::1]:29500"


def test_a_broken_sglang_falls_back_with_one_warning_naming_the_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An installed sglang whose utils fail to import: our copy builds the group, and the log
    says why, once per process."""
    (tmp_path / "sglang" / "srt").mkdir(parents=True)
    (tmp_path / "sglang" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "srt" / "__init__.py").write_text("")
    (tmp_path / "sglang" / "srt" / "utils.py").write_text(
        "raise ImportError('libcuda.so.1: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    _sglang_helper.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, "rollout_watchdog.common.torch_group"):
            assert _sglang_helper() is None
            assert _sglang_helper() is None
    finally:
        _sglang_helper.cache_clear()
        for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[name]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "ImportError: libcuda.so.1" in warnings[0]
