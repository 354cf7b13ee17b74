"""The node daemon as `rollout-watchdog run` starts it: the core with its control socket. The
one place where the core and the command layer meet (the core never imports commands)."""

from __future__ import annotations

from typing import Any

import zmq

from rollout_watchdog.config import NodeConfig
from rollout_watchdog.watchdog.commands import dispatcher
from rollout_watchdog.watchdog.control import ControlServer
from rollout_watchdog.watchdog.daemon import Daemon


def control_socket(daemon: Daemon) -> ControlServer:
    return ControlServer(zmq.Context.instance(), daemon.config.control,
                         dispatcher(daemon.supervisor), daemon.bad_message)


def node_daemon(config: NodeConfig, **kwargs: Any) -> Daemon:
    return Daemon(config, participants=[control_socket], **kwargs)
