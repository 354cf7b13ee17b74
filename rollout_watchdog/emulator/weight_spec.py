"""Which parameter names and shapes the emulator accepts in a weight update (``--weight-spec``).

- ``tiny`` (default): the tiny model's own parameters (``embed_tokens.weight``,
  ``mlp.weight``, ``mlp.bias``, ``lm_head.weight``, ``lm_head.bias``), loaded into it, so a refit
  changes what it generates.
- ``learn``: any names and shapes. The first refit defines the model: every name received until
  an update that carries a ``weight_version`` (``fleet.refit()`` sends it with its last bucket)
  becomes a parameter of that shape. From then on the spec is fixed, as a real model's is.
- ``PATH``: a JSON file ``{"name": [dim, ...], ...}`` (see :func:`write_weight_spec`) fixes the
  names and shapes from the start.

Outside ``tiny`` the received tensors are kept aside (the tiny model still generates), and the
checks are SGLang's: an unknown name fails the update with ``Failed to update parameter online:
'NAME'``, a wrong shape with a shape mismatch; a dtype is converted, as SGLang's copy does.

Imported by the main process (no torch here): a bad spec file is refused at start-up.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

TINY = "tiny"
LEARN = "learn"
ENV = "ROLLOUT_WATCHDOG_EMULATOR_WEIGHT_SPEC"  # the default of --weight-spec (else tiny)

Spec = dict[str, list[int]]


class SpecError(ValueError):
    """A weight spec file that cannot be used; the message names the file and the problem."""


def parse_spec(obj: Any, where: str) -> Spec:
    """``{"name": [dim, ...]}`` checked: names non-empty strings, dims non-negative ints."""
    if not isinstance(obj, dict) or not obj:
        raise SpecError(f"{where}: expected a non-empty JSON object "
                        '{"parameter.name": [dim, ...], ...}')
    spec: Spec = {}
    for name, shape in obj.items():
        if not name:
            raise SpecError(f"{where}: an empty parameter name")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise SpecError(f"{where}: {name!r}: the shape must be a list of non-negative "
                            f"integers, got {shape!r}")
        spec[name] = list(shape)
    return spec


def load_spec_file(path: str) -> Spec:
    """The spec in the JSON file at ``path``; SpecError naming the file otherwise."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except OSError as exc:
        raise SpecError(f"weight spec {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise SpecError(f"weight spec {path}: not JSON: {exc}") from exc
    return parse_spec(obj, f"weight spec {path}")


def resolve(value: str) -> str | Spec:
    """``tiny``, ``learn``, or the spec read from the file named ``value``."""
    if value in (TINY, LEARN):
        return value
    return load_spec_file(value)


def write_weight_spec(path: str, named_tensors: Iterable[tuple[str, Any]]) -> None:
    """Write the spec of ``named_tensors`` (``(name, tensor)``, e.g. ``model.named_parameters()``,
    or what the trainer's weight iterator yields) to ``path``, for ``--weight-spec PATH``."""
    spec = {name: [int(d) for d in tensor.shape] for name, tensor in named_tensors}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(spec, f, indent=1)
        f.write("\n")
