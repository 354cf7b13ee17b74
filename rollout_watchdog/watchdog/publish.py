"""The one publish point of the node daemon: every event is built and published here once, and
the event log, the metrics, the log and (later) the agent's outbox subscribe to it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from rollout_watchdog.common.events import Event
from rollout_watchdog.common.protocol import FORGETTING_KINDS
from rollout_watchdog.common.states import Cause, EngineState
from rollout_watchdog.watchdog.engine import EngineRuntime
from rollout_watchdog.watchdog.metrics import Metrics

log = logging.getLogger("rollout_watchdog.watchdog")
Subscriber = Callable[[Event], object]  # what it returns is ignored


class Publisher:
    def __init__(self, node_id: str, wall: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.wall = wall
        self._subscribers: list[Subscriber] = []

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append(subscriber)

    def emit(self, engine: EngineRuntime | None, kind: str, *, from_: str | None = None,
             to: str | None = None, cause: Cause | None = None, detail: str | None = None,
             **extra: Any) -> Event:
        """Build the event of this engine's current incarnation and publish it."""
        event = Event(ts=self.wall(), node_id=self.node_id,
                      engine=engine.id if engine else None,
                      incarnation=engine.incarnation if engine else None, kind=kind,
                      from_=from_, to=to, cause=str(cause) if cause else None, detail=detail,
                      extra=extra or None)
        self.publish(event)
        return event

    def publish(self, event: Event) -> None:
        for subscriber in self._subscribers:
            try:
                subscriber(event)
            except Exception:  # one broken subscriber must not silence the others
                log.exception("event subscriber %r failed", subscriber)


def log_event(event: Event) -> None:
    """The event as a log line, with its context as fields."""
    who = f"{event.engine}#{event.incarnation}" if event.engine else "daemon"
    what = f"{event.from_} -> {event.to}" if event.kind == "state" else event.kind
    log.info("%s %s%s%s", who, what, f" [{event.cause}]" if event.cause else "",
             f": {event.detail}" if event.detail else "",
             extra={k: v for k, v in (("engine", event.engine), ("kind", event.kind),
                                      ("incarnation", event.incarnation),
                                      ("cause", event.cause)) if v is not None})


def metrics_subscriber(metrics: Metrics) -> Subscriber:
    """Keeps the engine series of `metrics` in step with the events."""

    def on_event(event: Event) -> None:
        engine, extra = event.engine, event.extra or {}
        if engine is None:
            return
        if event.kind in FORGETTING_KINDS:   # no longer on this node: drop its series
            metrics.remove_engine(engine)
            return
        if event.incarnation is not None:
            metrics.set_incarnation(engine, event.incarnation)
        if event.kind in ("state", "adopted") and event.to:
            metrics.set_state(engine, event.to)
            if event.to == EngineState.STARTING:
                metrics.set_paused(engine, False)  # a pause belongs to its incarnation
        if "detected_after_s" in extra:
            metrics.detection(engine, event.cause or "", extra["detected_after_s"])
        if event.kind == "paused":
            metrics.set_paused(engine, True)
        elif event.kind in ("resumed", "pause_expired"):
            metrics.set_paused(engine, False)
        elif event.kind == "restart_counted":
            metrics.restart(engine, event.cause or "")
        elif event.kind == "signal_sent":
            metrics.kill(engine, event.cause or "", extra.get("signal", ""))

    return on_event
