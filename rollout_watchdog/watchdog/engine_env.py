"""The environment an engine starts with: the daemon's, less what is the daemon's own, with
exactly the GPUs of its spec.

Under Ray the daemon runs in an actor that reserved no GPU, and Ray gives such an actor
`CUDA_VISIBLE_DEVICES=""` (vllm#3198): inherited, it would hide every GPU from the engine. So
the daemon's value never decides an engine's GPUs when the spec names them, and an empty one is
never passed on. A non-empty inherited value is kept for an engine whose spec names no GPUs: an
operator who confines the daemon to some GPUs confines those engines too. The spec's own `env`
comes last and wins (check-config refuses one that disagrees with `gpus`).
"""

from __future__ import annotations

from collections.abc import Mapping

from rollout_watchdog.config import EngineConfig

# The daemon's own systemd handshake; an engine that inherited it could pose as the daemon.
SYSTEMD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
VISIBLE = "CUDA_VISIBLE_DEVICES"


def engine_environment(daemon_env: Mapping[str, str], cfg: EngineConfig) -> dict[str, str]:
    """The environment of a new process of `cfg`, from the daemon's `daemon_env`."""
    env = {k: v for k, v in daemon_env.items() if k not in SYSTEMD_ONLY_ENV}
    inherited = env.pop(VISIBLE, "")
    if cfg.gpus:
        env[VISIBLE] = ",".join(str(g) for g in cfg.gpus)
    elif inherited.strip():
        env[VISIBLE] = inherited
    env.update(cfg.env)
    return env
