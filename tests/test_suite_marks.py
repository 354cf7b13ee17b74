"""The suite's own bookkeeping (conftest.py): every module it names exists, and none of the
modules whose engines run without a model (--no-model) names a weight operation, so that a
refit test added to one of them fails here, not on an engine that refuses its weights."""

from __future__ import annotations

import re
from pathlib import Path

import conftest
import pytest

TESTS = Path(__file__).parent
# What a test that updates weights says: a refit, the lock's refit commands, the HTTP weight
# API, the weight-update group, the memory saver, the refit harnesses.
WEIGHT_OPERATION = re.compile(
    r"\brefit\(|refit_(acquire|commit|abort|members|begin)|update_weights|weights_update_group"
    r"|(begin|end)_weight_update|WeightGroup|weight_group|refit_trainer|RefitTrainer"
    r"|memory_occupation|refit_harness")


def test_every_module_and_test_named_in_conftest_exists() -> None:
    named = (conftest.NO_MODEL_MODULES | conftest.HEAVY_MODULES | conftest.SERIAL_MODULES
             | set(conftest.SERIAL_TESTS) | set(conftest.HEAVY_LONGEST))
    assert sorted(m for m in named if not (TESTS / f"{m}.py").is_file()) == []
    listed = [*conftest.SERIAL_TESTS.items(), *conftest.HEAVY_LONGEST.items()]
    assert sorted(f"{m}::{t}" for m, tests in listed for t in tests
                  if f"def {t}(" not in (TESTS / f"{m}.py").read_text()) == []
    assert conftest.HEAVY_WHOLE_MODULES <= conftest.HEAVY_MODULES
    assert set(conftest.HEAVY_LONGEST) <= conftest.HEAVY_MODULES


def test_the_pass_marks_come_from_conftest_only() -> None:
    """The first two passes of scripts/test.sh import only the modules conftest lists for them,
    so a module that marked its own tests heavy would have them run by no pass."""
    marking = sorted(p.name for p in TESTS.glob("test_*.py")
                     if re.search(r"mark\.(serial|heavy)\b", p.read_text()))
    assert marking == [], f"{marking}: list them in conftest.py instead"


@pytest.mark.parametrize("module", sorted(conftest.NO_MODEL_MODULES))
def test_a_module_without_a_model_names_no_weight_operation(module: str) -> None:
    text = (TESTS / f"{module}.py").read_text()
    found = sorted({m.group(0) for m in WEIGHT_OPERATION.finditer(text)})
    assert not found, (
        f"{module} names {found}, but its engines run with --no-model (conftest.py "
        "NO_MODEL_MODULES), which refuses weight updates: take it out of NO_MODEL_MODULES, or "
        "move the test that updates weights to another module")
