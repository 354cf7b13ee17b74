"""The scheduler child's side of a weight refit: SGLang's model-runner weight updater.

Imported only by the scheduler child (it imports torch). Like SGLang, the scheduler does the
collective work itself, in its event loop: while a rendezvous or broadcast is in progress it
neither generates nor answers anything else. The group is built with the same
``init_custom_process_group`` the trainer uses (rank = ``rank_offset`` + TP rank 0), so the
store keys match. Messages are SGLang 0.5.23's.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rollout_watchdog.common.torch_group import (
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)

TP_RANK = 0  # the emulator is one TP rank
NO_SESSION = (
    "update_weights_from_distributed must run between "
    "begin_weight_update() and end_weight_update()"
)

Result = tuple[bool, str]


def _dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> torch.bfloat16 (SGLang: ``getattr(torch, dtype)``)."""
    dtype = getattr(torch, name)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"torch.{name} is not a dtype")
    return dtype


class HeldWeights:
    """The parameters of a model the emulator does not run (``--weight-spec learn`` or a spec
    file, see :mod:`weight_spec`): received tensors are checked against the spec and kept."""

    def __init__(self, spec: dict[str, list[int]] | None) -> None:
        self.spec = dict(spec or {})
        self.learning = spec is None  # learn: the first refit defines the names and shapes
        self.tensors: dict[str, torch.Tensor] = {}

    def target(self, name: str, received: torch.Tensor) -> torch.Tensor:
        """Where ``received`` goes; KeyError for a name the model does not have (as SGLang's
        ``params_dict[name]``)."""
        if name not in self.spec:
            if not self.learning:
                raise KeyError(name)
            self.spec[name] = list(received.shape)
        if name not in self.tensors:
            self.tensors[name] = torch.empty(self.spec[name], dtype=received.dtype)
        return self.tensors[name]

    def loaded(self, sets_version: bool) -> None:
        """After a successful load: the update that sets a version ends the learning."""
        if sets_version and self.spec:
            self.learning = False


class WeightSync:
    """Weight-update groups by name, the begin/end session, receive and load."""

    def __init__(self, model: nn.Module, session_required: bool,
                 held: HeldWeights | None = None) -> None:
        self.model = model
        self.held = held  # None: updates load into the tiny model itself
        self.session_required = session_required  # SGLang 0.5.21+
        self.session_open = False
        self.groups: dict[str, Any] = {}  # group name -> torch ProcessGroup

    def init_group(self, args: dict[str, Any]) -> Result:
        """Join the group as rank ``rank_offset``; blocks until every member has joined."""
        try:
            self.groups[args["group_name"]] = init_custom_process_group(
                backend=args["backend"],
                init_method=tcp_init_method(args["master_address"], args["master_port"]),
                timeout=None,  # torch's default, 30 min, as in SGLang
                world_size=args["world_size"],
                rank=args["rank_offset"] + TP_RANK,
                group_name=args["group_name"],
            )
        except Exception as exc:  # noqa: BLE001 - SGLang answers every failure with a message
            return False, f"Failed to initialize custom process group: {exc}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> Result:
        pg = self.groups.pop(group_name, None)
        if pg is None:
            return False, "The group to be destroyed does not exist."
        try:
            destroy_process_group(pg)
        except Exception as exc:  # noqa: BLE001
            return False, f"Failed to destroy custom process group: {exc}."
        return True, "Succeeded to destroy custom process group."

    def begin(self) -> Result:
        if self.session_open:
            return False, (
                "a weight-update session is already open; call end_weight_update() first"
            )
        self.session_open = True
        return True, "Success"

    def end(self) -> Result:
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def check_session(self) -> Result | None:
        """The refusal of an update outside a session (0.5.21+), before joining anything."""
        if self.session_required and not self.session_open:
            return False, NO_SESSION
        return None

    def receive(self, args: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """Receive the tensors broadcast by rank 0, in ``names`` order; raises on misuse."""
        group_name = args["group_name"]
        if group_name not in self.groups:
            raise AssertionError(
                f"Group {group_name} not in {list(self.groups)}. "
                "Please call `init_weights_update_group` first."
            )
        pg = self.groups[group_name]
        names, dtypes, shapes = args["names"], args["dtypes"], args["shapes"]
        if args["load_format"] == "flattened_bucket":
            return _receive_flattened(pg, names, dtypes, shapes)
        weights = [
            (name, torch.empty(shape, dtype=_dtype(dtype)))
            for name, dtype, shape in zip(names, dtypes, shapes, strict=True)
        ]
        handles = [torch.distributed.broadcast(t, src=0, group=pg, async_op=True)
                   for _, t in weights]
        for handle in handles:
            handle.wait()
        return weights

    def load(self, weights: list[tuple[str, torch.Tensor]], sets_version: bool = False
             ) -> Result:
        """Copy received tensors into the model's parameters (a failure leaves them partial).
        ``sets_version``: the update carries a ``weight_version`` (ends ``learn``'s learning)."""
        held = self.held
        params = dict(self.model.named_parameters()) if held is None else {}
        try:
            with torch.no_grad():
                for name, tensor in weights:
                    param = params[name] if held is None else held.target(name, tensor)
                    if param.shape != tensor.shape:
                        raise ValueError(
                            f"shape mismatch for {name}: received {list(tensor.shape)}, "
                            f"the parameter is {list(param.shape)}"
                        )
                    param.copy_(tensor)
        except Exception as exc:  # noqa: BLE001
            return False, (
                f"Failed to update parameter online: {exc}. The full weights of the "
                "ModelRunner are partially updated. Please discard the whole weights."
            )
        if held is not None:
            held.loaded(sets_version)
        return True, "Succeeded to update parameter online."


def _receive_flattened(
    pg: Any, names: list[str], dtypes: list[str], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """SGLang's FlattenedTensorBucket: one uint8 tensor, each tensor's bytes back to back in
    ``names`` order (each at an offset aligned to its dtype's size)."""
    layout = []
    offset = 0
    for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
        dtype, size = _dtype(dtype_name), torch.Size(shape)
        if any(dim < 0 for dim in size):
            raise ValueError(f"Negative dimension in received tensor {name}: {size}")
        if offset % dtype.itemsize:
            raise ValueError(
                f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}"
            )
        nbytes = size.numel() * dtype.itemsize
        layout.append((name, dtype, size, offset, offset + nbytes))
        offset += nbytes
    if not layout:
        raise ValueError("Cannot create empty tensor bucket")
    flat = torch.empty(offset, dtype=torch.uint8)
    torch.distributed.broadcast(flat, src=0, group=pg)
    return [(name, flat[start:end].view(dtype).reshape(size))
            for name, dtype, size, start, end in layout]
