"""`rollout-watchdog --help` summarizes each control command by its docstring's whole first
paragraph (issue 13 §4.8: `register` was cut off mid-sentence)."""

from __future__ import annotations

import inspect

from rollout_watchdog.cli import build_parser
from rollout_watchdog.watchdog.commands import COMMANDS


def test_every_command_summary_is_a_whole_first_paragraph() -> None:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    summaries = {c.dest: c.help for c in sub._choices_actions}
    checked = 0
    for name, summary in summaries.items():
        if name not in COMMANDS:
            continue
        first = " ".join(inspect.cleandoc(COMMANDS[name].__doc__ or "").split("\n\n")[0].split())
        assert summary == first, name
        assert summary and summary.rstrip(")").endswith("."), (name, summary)
        checked += 1
    assert checked >= 8
    assert summaries["register"].endswith("probed and killed like the node's own, never "
                                          "relaunched.")
