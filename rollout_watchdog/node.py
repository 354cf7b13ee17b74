"""The node daemon as `rollout-watchdog run` starts it: the core with its control socket and,
when the config names a coordinator, its link to it. The one place where the core and the
command layer meet (the core never imports commands)."""

from __future__ import annotations

from typing import Any

import zmq

from rollout_watchdog.agent.link import NodeLink
from rollout_watchdog.config import NodeConfig
from rollout_watchdog.watchdog.commands import dispatcher
from rollout_watchdog.watchdog.control import ControlServer
from rollout_watchdog.watchdog.daemon import Daemon, ParticipantFactory
from rollout_watchdog.watchdog.engine_info import EngineInfo
from rollout_watchdog.watchdog.status import engine_status


def control_socket(daemon: Daemon) -> ControlServer:
    return ControlServer(zmq.Context.instance(), daemon.config.control,
                         dispatcher(daemon.supervisor), daemon.bad_message)


def fleet_link(daemon: Daemon) -> NodeLink:
    """The link to the coordinator: it hears every event, runs the same commands, and shows
    itself in `status` ("link") and the metrics."""
    config = daemon.config
    assert config.coordinator is not None
    supervisor = daemon.supervisor

    def status_of(engine_id: str) -> dict[str, Any] | None:
        engine = supervisor.engines.get(engine_id)
        return (None if engine is None else
                engine_status(engine, supervisor.clock, supervisor.kernel_boot))

    link = NodeLink(zmq.Context.instance(), endpoint=config.coordinator,
                    node_id=config.node_id, boot=daemon.boot_id,
                    snapshot=lambda: list(daemon.status()["engines"]),
                    dispatch=dispatcher(supervisor), clock=daemon.clock,
                    engine_status=status_of, key=config.key,
                    coordinator_key=config.coordinator_key, metrics=daemon.metrics,
                    metrics_port=config.metrics_port)
    daemon.publisher.subscribe(link.on_event)
    supervisor.status_parts["link"] = link.status
    return link


def engine_info(daemon: Daemon) -> EngineInfo:
    """Each engine's tp_size from its /server_info, for status and the fleet view."""
    return EngineInfo(daemon.supervisor.engines, daemon.supervisor.emit)


def node_daemon(config: NodeConfig, **kwargs: Any) -> Daemon:
    participants: list[ParticipantFactory] = [control_socket, engine_info]
    if config.coordinator:
        participants.append(fleet_link)
    return Daemon(config, participants=participants, **kwargs)
