"""The systemd unit (verified by systemd itself where available) and the example node config."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollout_watchdog.watchdog.daemon import DETACH_EXIT_CODE

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

SYSTEMD_DIR = Path(__file__).resolve().parent.parent / "systemd"
UNIT = SYSTEMD_DIR / "rollout-watchdog.service"
EXAMPLE = SYSTEMD_DIR / "config.example.toml"


def _unit() -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read(UNIT)
    return parser


def _verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True, text=True, timeout=60,
    )


def _executable() -> str:
    """An absolute path that exists: verify rejects an ExecStart binary that is not installed."""
    script = Path(sys.executable).parent / "rollout-watchdog"
    return str(script if script.exists() else Path(sys.executable))


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    control = tmp_path / "control" / "control-check.service"
    control.parent.mkdir()
    control.write_text(f"[Service]\nType=oneshot\nExecStart={sys.executable} -c pass\n")
    if _verify(control).returncode != 0:
        pytest.skip("systemd-analyze verify does not work here, even on a trivial unit")

    text = UNIT.read_text()
    assert "ExecStart=/usr/local/bin/rollout-watchdog run " in text
    unit = tmp_path / UNIT.name
    unit.write_text(
        text.replace("ExecStart=/usr/local/bin/rollout-watchdog", f"ExecStart={_executable()}")
    )
    result = _verify(unit)
    output = result.stdout + result.stderr
    about_unit = [line for line in output.splitlines() if UNIT.name in line or str(unit) in line]
    assert result.returncode == 0, output
    assert about_unit == [], output


def test_unit_key_settings() -> None:
    unit = _unit()
    service = unit["Service"]
    assert service["Type"] == "notify"
    assert service["NotifyAccess"] == "main"
    assert service["KillMode"] == "process"
    # `systemctl restart` (DESIGN: the daemon re-adopts the running engines) sends the signal
    # on which the daemon leaves its engines running; its exit code is a success to systemd,
    # and one that restarts it when sent from outside a restart job.
    assert service["RestartKillSignal"] == "SIGUSR2"
    assert str(DETACH_EXIT_CODE) in service["SuccessExitStatus"].split()
    assert str(DETACH_EXIT_CODE) in service["RestartForceExitStatus"].split()
    assert service["Delegate"] == "yes"  # a cgroup per engine incarnation (watchdog/cgroup.py)
    assert service["Restart"] in ("on-failure", "always")
    assert service["OOMPolicy"] == "continue"
    assert service["RuntimeDirectory"] == "rollout-watchdog"
    assert service["StateDirectory"] == "rollout-watchdog"
    assert service["ExecStart"].split()[1:] == [
        "run", "--config", "/etc/rollout-watchdog/config.toml"
    ]
    assert int(service["WatchdogSec"]) > 0
    # The stop timeout must cover the engines' grace period and the bounded kill wait.
    restart = tomllib.loads(EXAMPLE.read_text())["restart"]
    assert int(service["TimeoutStopSec"]) > restart["grace_s"] + restart["kill_timeout_s"]
    assert "StartLimitBurst" in unit["Unit"]
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_example_config_follows_the_contract() -> None:
    config = tomllib.loads(EXAMPLE.read_text())
    assert {"node_id", "control", "state_dir", "probe", "restart", "engine"} <= config.keys()
    assert "coordinator" not in config, "the example runs alone; coordinator is commented out"
    assert "# coordinator = " in EXAMPLE.read_text()
    assert config["control"] == "ipc:///run/rollout-watchdog/control"
    assert config["state_dir"] == "/var/lib/rollout-watchdog"
    assert isinstance(config["metrics_port"], int)
    assert set(config["probe"]) == {
        "liveness_interval_s", "health_path", "health_interval_s", "health_timeout_s",
        "failure_threshold", "startup_timeout_s",
    }
    assert set(config["restart"]) == {
        "grace_s", "backoff_initial_s", "backoff_max_s", "max_restarts", "window_s",
        "stable_s", "kill_timeout_s", "release_timeout_s",
    }

    engines = config["engine"]
    assert len(engines) == 2
    assert len({e["id"] for e in engines}) == 2
    for engine in engines:
        assert {"id", "url", "command", "gpus", "env"} <= engine.keys()
        command = engine["command"]
        assert command[:3] == ["python", "-m", "sglang.launch_server"]
        port = command[command.index("--port") + 1]
        assert engine["url"].endswith(f":{port}")
        assert "--nccl-port" in command
        assert all(isinstance(v, str) for v in engine["env"].values())
    assert not set(engines[0]["gpus"]) & set(engines[1]["gpus"])
    assert {e.get("restart_policy", "immediate") for e in engines} == {"immediate", "deferred"}
    assert any("probe" in e and set(e["probe"]) <= set(config["probe"]) for e in engines)
