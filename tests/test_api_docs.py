"""The Python API reference (issue 13 §4.5): `scripts/api-docs.sh` builds it with pdoc from the
docstrings, and no public name goes without one: the names exported from `rollout_watchdog`,
`FleetClient`'s public methods, the fields of `EngineView`, and the errors."""

from __future__ import annotations

import dataclasses
import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rollout_watchdog

pdoc_doc = pytest.importorskip("pdoc.doc", reason="pdoc (the test extra) builds the reference")

REPO = Path(__file__).resolve().parent.parent
EXPORTED = [name for name in rollout_watchdog.__all__ if not name.startswith("__")]


def pdoc_class(cls: type) -> Any:
    """pdoc's view of a class, as the reference shows it (attribute docstrings included)."""
    found = pdoc_doc.Module.from_name(cls.__module__).get(cls.__qualname__)
    assert isinstance(found, pdoc_doc.Class), cls
    return found


def own_docstring(obj: object) -> str:
    """The object's own docstring: not inherited, not the signature a dataclass makes up."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    name = getattr(obj, "__name__", "")
    if not doc or doc.startswith(f"{name}("):
        return ""
    return inspect.cleandoc(doc)


@pytest.mark.parametrize("name", EXPORTED)
def test_every_exported_name_has_a_docstring(name: str) -> None:
    assert own_docstring(getattr(rollout_watchdog, name)), f"rollout_watchdog.{name}"


def test_every_public_method_of_the_fleet_client_has_a_docstring() -> None:
    methods = [m for m in pdoc_class(rollout_watchdog.FleetClient).members.values()
               if isinstance(m, pdoc_doc.Function) and not m.name.startswith("_")]
    assert {"engines", "nodes", "status", "refit", "wait_until",
            "wait_router_synced"} <= {m.name for m in methods}
    assert [m.name for m in methods if not m.docstring.strip()] == []


def test_every_field_of_an_engine_view_is_documented() -> None:
    cls = pdoc_class(rollout_watchdog.EngineView)
    fields = [f.name for f in dataclasses.fields(rollout_watchdog.EngineView)]
    assert "weight_version" in fields and "serving" in fields
    assert [f for f in fields if not cls.members[f].docstring.strip()] == []


def test_every_exported_error_says_when_it_is_raised() -> None:
    errors = [getattr(rollout_watchdog, n) for n in EXPORTED
              if inspect.isclass(getattr(rollout_watchdog, n))
              and issubclass(getattr(rollout_watchdog, n), Exception)]
    assert {e.__name__ for e in errors} >= {"RolloutWatchdogError", "EngineLost", "LeaseLost",
                                            "CoordinatorUnavailable", "CommandRefused"}
    assert [e.__name__ for e in errors if not own_docstring(e)] == []
    assert all(issubclass(e, rollout_watchdog.RolloutWatchdogError) for e in errors)


def test_the_script_builds_the_reference(tmp_path: Path) -> None:
    out = tmp_path / "api"
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(["bash", str(REPO / "scripts" / "api-docs.sh"), str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    page = (out / "rollout_watchdog.html").read_text()
    for anchor in ("FleetClient.wait_router_synced", "EngineView.weight_version", "EngineLost",
                   "Coordinator"):
        assert f'id="{anchor}"' in page, anchor
    assert (out / "rollout_watchdog" / "refit_bridge" / "refit.html").exists()
    assert (out / "rollout_watchdog" / "emulator.html").exists()
    assert not (out / "rollout_watchdog" / "watchdog").exists()   # internals stay out
