"""A weight-update process group built exactly the way an SGLang engine builds its side.

SGLang's ``/init_weights_update_group`` does not use ``torch.distributed.init_process_group``:
it calls ``sglang.srt.utils.init_custom_process_group``, which rendezvouses on its own TCPStore,
wraps it in ``PrefixStore(group_name, ...)`` and creates the group with torch's private
``_new_process_group_helper``. The store keys differ from a plain ``init_process_group``, so
a trainer that builds its side any other way never meets the engines (both wait out the group
timeout). The trainer (rank 0) and the emulator's engines both call this one function.

Importing this module does not import torch; the functions do, when called.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
import logging
from typing import TYPE_CHECKING, Any, cast

from rollout_watchdog.common.validate import bracket_host

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import GroupName  # torch 2.13's NewType

log = logging.getLogger(__name__)


def tcp_init_method(address: str, port: int) -> str:
    """``tcp://host:port`` (an IPv6 address in brackets), as SGLang's NetworkAddress.to_tcp:
    the group's rendezvous address, for the trainer and the emulated engines alike."""
    return f"tcp://{bracket_host(address)}:{port}"


@functools.cache
def _sglang_helper() -> Any | None:
    """SGLang's own ``init_custom_process_group`` when sglang is installed, else None. Looked
    up once per process, so a broken sglang is reported once (a warning naming the error)."""
    if importlib.util.find_spec("sglang") is None:
        return None
    try:
        utils = importlib.import_module("sglang.srt.utils")
    except Exception as exc:  # noqa: BLE001 - a broken sglang install falls back to our copy
        log.warning("sglang is installed but sglang.srt.utils does not import (%s: %s): the "
                    "weight-update group is built by rollout_watchdog's own copy of its "
                    "construction", type(exc).__name__, exc)
        return None
    return getattr(utils, "init_custom_process_group", None)


def _backend_options_kwarg(torch_version: str) -> str:
    """torch 2.6 renamed ``pg_options`` of ``_new_process_group_helper`` to ``backend_options``."""
    parts = torch_version.split("+", 1)[0].split(".")
    major_minor = (int(parts[0]), int(parts[1]))
    return "backend_options" if major_minor >= (2, 6) else "pg_options"


def init_custom_process_group(
    backend: str,
    init_method: str,
    timeout: datetime.timedelta | None,
    world_size: int,
    rank: int,
    group_name: str,
) -> ProcessGroup:
    """Join (or, as rank 0, host) the group ``group_name`` at ``init_method`` (``tcp://h:p``).

    Blocks until all ``world_size`` members have joined or ``timeout`` (torch's default
    process-group timeout, 30 min, when None) runs out. Needs no default process group.
    """
    if not group_name:
        raise ValueError("group_name must not be empty")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a group of world_size {world_size}")
    sglang_helper = _sglang_helper()
    if sglang_helper is not None:
        pg: ProcessGroup = sglang_helper(
            backend=backend,
            init_method=init_method,
            timeout=timeout,
            world_size=world_size,
            rank=rank,
            group_name=group_name,
        )
        return pg

    import torch
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        default_pg_timeout,
    )
    from torch.distributed.rendezvous import rendezvous

    if timeout is None:
        timeout = default_pg_timeout
    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    options_kwarg = _backend_options_kwarg(str(torch.__version__))
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=cast("GroupName", group_name),
        **{options_kwarg: None},
        timeout=timeout,
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def destroy_process_group(pg: ProcessGroup | None) -> None:
    """Tear down a group made by :func:`init_custom_process_group`; None or gone is a no-op.

    Only for a group whose collectives have finished: destroying a group while a collective
    is hung may itself hang (SGLANG.md: restart the engine instead).
    """
    if pg is None:
        return
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    if pg not in _world.pg_map:
        return
    dist.destroy_process_group(pg)
