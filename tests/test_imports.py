"""Import rules: the node daemon, the fleet's agent side (link, coordinator, FleetClient) and the
CLI's control commands stay light.

A daemon on every GPU node must not pay for torch, ray or sglang (seconds of start-up, GiBs of
memory), and the CLI's control commands must not load the emulator (tens of ms on every call).
Each check runs in a fresh interpreter, so what other tests imported does not count.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

FORBIDDEN = ("torch", "ray", "sglang", "rollout_watchdog.emulator")

# Imports every module of the daemon package (found by pkgutil, so new modules are covered),
# then runs the CLI's control-command paths: parser, `status --help`, and `status` with no
# daemon there. Prints the loaded modules as JSON on the last line.
LIGHT_PATHS = """
import contextlib, importlib, io, pkgutil
import rollout_watchdog.agent
import rollout_watchdog.common
import rollout_watchdog.node
import rollout_watchdog.watchdog
for pkg in (rollout_watchdog.watchdog, rollout_watchdog.agent, rollout_watchdog.common):
    for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(info.name)
from rollout_watchdog import Coordinator, FleetClient
import rollout_watchdog.watchdog.daemon
from rollout_watchdog import cli
cli.build_parser()
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        cli.main(["status", "--help"])
    except SystemExit:
        pass
    cli.main(["status", "--control", "ipc:///nonexistent/rollout-watchdog-test", "--timeout",
              "0.5"])
    cli.main(["status", "--coordinator", "tcp://127.0.0.1:9", "--timeout", "0.5"])
"""

REPORT = """
import json, sys
print(json.dumps(sorted(sys.modules)))
"""


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code) + REPORT],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def _forbidden(modules: set[str]) -> list[str]:
    return sorted(m for m in modules
                  if any(m == name or m.startswith(name + ".") for name in FORBIDDEN))


def test_daemon_and_control_commands_load_no_heavy_module() -> None:
    loaded = _loaded_after(LIGHT_PATHS)
    daemon_modules = {m for m in loaded if m.startswith("rollout_watchdog.watchdog.")}
    assert {"rollout_watchdog.watchdog.daemon", "rollout_watchdog.cli.client",
            "rollout_watchdog.refit_bridge.coordinator",
            "rollout_watchdog.refit_bridge.client"} <= loaded
    assert len(daemon_modules) >= 5, daemon_modules  # the walk found the package's modules
    assert _forbidden(loaded) == []


def test_the_check_sees_a_forbidden_import() -> None:
    """The same check flags the emulator once it is loaded, so the rule above can fail."""
    loaded = _loaded_after("import rollout_watchdog.emulator.server")
    assert "rollout_watchdog.emulator.server" in _forbidden(loaded)


# The node daemon's own start-up (what `rollout-watchdog run` imports) and a control command of
# the CLI: no HTTP client library and no asyncio (a third of their start-up before: `requests`
# for the coordinator's router defaults, asyncio through pyzmq's monitor helpers).
DAEMON_AND_CLI = """
import contextlib, io
import rollout_watchdog.node
import rollout_watchdog.watchdog.daemon
from rollout_watchdog import cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    cli.main(["status", "--control", "ipc:///nonexistent/rollout-watchdog-test", "--timeout",
              "0.5"])
"""


def test_the_daemon_and_a_cli_call_start_without_requests_or_asyncio() -> None:
    loaded = _loaded_after(DAEMON_AND_CLI)
    assert {"rollout_watchdog.watchdog.daemon", "rollout_watchdog.cli.client",
            "rollout_watchdog.refit_bridge.router_sync"} <= loaded   # (the parser's defaults)
    assert sorted(m for m in loaded if m.split(".")[0] in ("requests", "asyncio")) == []
