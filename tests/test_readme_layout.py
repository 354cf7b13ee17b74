"""The README's Layout section is how a newcomer finds a concept by its name: its entry for each
subpackage names every module of that subpackage, and none that is gone. bench/README.md's
table says what each benchmark measures, for every one of them."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "rollout_watchdog"
ENTRY = re.compile(r"^- `rollout_watchdog/([a-z_]+)/`", re.MULTILINE)
NAMED = re.compile(r"`([a-z_0-9]+\.py)`")


def section(path: Path, heading: str) -> str:
    """The Markdown file's `## heading` section, up to the next one (or the end)."""
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def layout_section() -> str:
    return section(REPO / "README.md", "Layout")


def entries() -> dict[str, str]:
    """Each subpackage's entry in the Layout section: from its bullet to the next bullet."""
    section = layout_section()
    found = {}
    for match in ENTRY.finditer(section):
        end = section.find("\n- ", match.end())
        found[match.group(1)] = section[match.start():None if end == -1 else end]
    return found


def modules(package: Path) -> set[str]:
    """The package's modules, bar __init__ and __main__ (its entry says what they hold)."""
    return {path.name for path in package.glob("*.py")
            if path.name not in ("__init__.py", "__main__.py")}


def subpackages() -> list[Path]:
    return sorted(path.parent for path in PACKAGE.glob("*/__init__.py"))


def test_each_subpackage_has_an_entry_that_names_each_of_its_modules() -> None:
    found = entries()
    missing = {}
    for package in subpackages():
        entry = found.get(package.name)
        assert entry is not None, f"README.md's Layout section has no entry for {package.name}/"
        unnamed = sorted(name for name in modules(package) if f"`{name}`" not in entry)
        if unnamed:
            missing[package.name] = unnamed
    assert not missing, f"README.md's Layout section does not name: {missing}"


def test_the_top_level_modules_are_named() -> None:
    section = layout_section()
    unnamed = sorted(name for name in modules(PACKAGE) | {"__init__.py"}
                     if f"rollout_watchdog/{name}`" not in section and f"`{name}`" not in section)
    assert not unnamed, f"README.md's Layout section does not name: {unnamed}"


def test_no_entry_names_a_module_that_is_gone() -> None:
    found = entries()
    assert found, "no subpackage entry found in the Layout section: is ENTRY still right?"
    gone = {name: sorted(set(NAMED.findall(entry)) - modules(PACKAGE / name) - {"__init__.py"})
            for name, entry in found.items()}
    gone = {name: names for name, names in gone.items() if names}
    assert not gone, f"README.md's Layout section names modules that do not exist: {gone}"


def test_the_bench_table_says_what_each_benchmark_measures() -> None:
    table = section(REPO / "bench" / "README.md", "What each one measures")
    scripts = {path.name for path in (REPO / "bench").glob("[!_]*.py")}
    assert scripts, "no benchmark found"
    listed = set(re.findall(r"^\| `([a-z_]+\.py)` \|", table, re.MULTILINE))
    assert listed == scripts, (f"bench/README.md's table lacks {sorted(scripts - listed)}, "
                               f"lists what is gone: {sorted(listed - scripts)}")
