"""The style's rule, kept: a module that grows past 500 lines is split before more is added to
it (each module one job, found by its name)."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "rollout_watchdog"
MAX_LINES = 500


def test_no_module_of_the_package_is_over_500_lines() -> None:
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50, "the package's modules were not found"
    over = {name: lines for name, lines in sizes.items() if lines > MAX_LINES}
    assert not over, f"split these before adding to them (lines): {over}"
