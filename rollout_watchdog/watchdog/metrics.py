"""Prometheus metrics of the node daemon.

The metrics live in a registry of their own, so that tests (and a process embedding several
daemons) never see series from another instance. Every update is an in-memory operation under a
short lock: the main loop calls them inline, and the HTTP server renders from its own thread.
"""

from __future__ import annotations

import threading
from enum import Enum
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics import MetricWrapperBase

from rollout_watchdog.common.metrics_server import MAX_CONNECTIONS, TIMEOUT_S, MetricsServer
from rollout_watchdog.common.states import EngineState

STATES = tuple(state.value for state in EngineState)

# Probe latency: a healthy /health_generate answers in milliseconds, a failing one at the timeout.
_PROBE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60)
# Detection latency: crashes within milliseconds, hangs after threshold x (interval + timeout).
_DETECTION_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
)
# Main loop iteration: should stay well under a millisecond; seconds mean the loop was blocked.
_LOOP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1, 5)


def _label(value: str) -> str:
    """A label value: an Enum member's value, or the string itself."""
    return str(value.value) if isinstance(value, Enum) else str(value)


class Metrics:
    """The daemon's metrics, with one update method per event the main loop knows about."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self._state = Gauge(
            "rollout_watchdog_engine_state",
            "1 for the engine's current supervision state, 0 for the others.",
            ["engine", "state"], registry=reg,
        )
        self._paused = Gauge(
            "rollout_watchdog_engine_paused",
            "1 while deep probes of the engine are paused.",
            ["engine"], registry=reg,
        )
        self._incarnation = Gauge(
            "rollout_watchdog_engine_incarnation",
            "Incarnation of the engine: 1 at the first launch, +1 at every relaunch.",
            ["engine"], registry=reg,
        )
        self._restarts = Counter(
            "rollout_watchdog_restarts_total",
            "Engine relaunches, by the cause of the failure or command that led to them.",
            ["engine", "cause"], registry=reg,
        )
        self._kills = Counter(
            "rollout_watchdog_kills_total",
            "Signals sent to engine process groups, by cause and signal.",
            ["engine", "cause", "signal"], registry=reg,
        )
        self._probe_latency = Histogram(
            "rollout_watchdog_probe_latency_seconds",
            "Duration of deep health probes, passing or not.",
            ["engine"], buckets=_PROBE_BUCKETS, registry=reg,
        )
        self._probes = Counter(
            "rollout_watchdog_probes_total",
            "Deep health probes by result (ok or failed).",
            ["engine", "result"], registry=reg,
        )
        self._detection = Histogram(
            "rollout_watchdog_detection_latency_seconds",
            "From the first evidence of a failure to the failure being declared.",
            ["engine", "cause"], buckets=_DETECTION_BUCKETS, registry=reg,
        )
        self._loop = Histogram(
            "rollout_watchdog_loop_iteration_seconds",
            "Duration of one iteration of the daemon's main loop.",
            buckets=_LOOP_BUCKETS, registry=reg,
        )
        self._log_dropped = Gauge(
            "rollout_watchdog_log_lines_dropped",
            "Log lines dropped since the daemon started because its stderr was not read.",
            registry=reg,
        )
        self._event_log_errors = Gauge(
            "rollout_watchdog_event_log_write_errors",
            "Events that could not be appended to events.jsonl (they stay in memory).",
            registry=reg,
        )
        self._bad_control = Counter(
            "rollout_watchdog_bad_control_messages_total",
            "Control messages that were malformed, oversized or unknown, and were rejected.",
            registry=reg,
        )
        self._link_bad = Counter(
            "rollout_watchdog_link_bad_messages_total",
            "Frames from the coordinator dropped by the node link, by reason: undecodable, "
            "unexpected_kind, protocol_error (a connection ZMQ dropped, e.g. for an oversized "
            "frame, dialed again).",
            ["reason"], registry=reg,
        )
        self._link_dropped = Counter(
            "rollout_watchdog_link_outbox_dropped_total",
            "Events dropped from the node link's full outbox before the coordinator "
            "acknowledged them (the next HELLO's snapshot supersedes them).",
            registry=reg,
        )
        self._link_outbox = Gauge(
            "rollout_watchdog_link_outbox_events",
            "Events in the node link's outbox, waiting for the coordinator's acknowledgement.",
            registry=reg,
        )
        self._coordinator_connected = Gauge(
            "rollout_watchdog_coordinator_connected",
            "1 while the node link is handshaken and the coordinator spoke within the "
            "heartbeat timeout.",
            registry=reg,
        )
        # Label sets created per engine, so remove_engine can drop exactly those series.
        self._series: dict[str, set[tuple[MetricWrapperBase, tuple[str, ...]]]] = {}
        self._lock = threading.Lock()
        self._server: MetricsServer | None = None

    def _labels(self, metric: MetricWrapperBase, engine: str, *rest: str) -> Any:
        """The child of ``metric`` for these labels, remembered under ``engine``.

        str enums (states.EngineState, Cause) are taken by value: prometheus_client would
        otherwise label them with str(), which is "Cause.EXITED" rather than "exited".
        """
        values = tuple(_label(v) for v in (engine, *rest))
        with self._lock:
            self._series.setdefault(values[0], set()).add((metric, values))
        return metric.labels(*values)

    def start_server(self, port: int, host: str = "127.0.0.1", *,
                     max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S
                     ) -> None:
        """Serve ``/metrics`` over HTTP from one thread, with bounded connections (see
        metrics_server); OSError if the port is taken."""
        self.stop_server()
        server = MetricsServer(self.render, host, port, max_connections=max_connections,
                               timeout_s=timeout_s)
        server.start()
        self._server = server

    def stop_server(self) -> None:
        """Close the HTTP server and its port, so a restarted daemon in this process can bind."""
        if self._server is not None:
            self._server.stop()
        self._server = None

    def set_state(self, engine: str, state: str) -> None:
        """Move the engine's state gauge to ``state`` (one of STATES)."""
        current = _label(state)
        if current not in STATES:
            raise ValueError(f"unknown engine state {state!r}")
        for name in STATES:
            self._labels(self._state, engine, name).set(1 if name == current else 0)

    def set_paused(self, engine: str, paused: bool) -> None:
        """Record whether the engine's deep probes are paused."""
        self._labels(self._paused, engine).set(1 if paused else 0)

    def set_incarnation(self, engine: str, n: int) -> None:
        """Record the engine's current incarnation."""
        self._labels(self._incarnation, engine).set(n)

    def restart(self, engine: str, cause: str) -> None:
        """Count a relaunch of the engine."""
        self._labels(self._restarts, engine, cause).inc()

    def kill(self, engine: str, cause: str, signal: str) -> None:
        """Count a signal (e.g. "SIGTERM", "SIGKILL") sent to the engine."""
        self._labels(self._kills, engine, cause, signal).inc()

    def probe(self, engine: str, seconds: float, ok: bool) -> None:
        """Record one finished deep probe."""
        self._labels(self._probe_latency, engine).observe(seconds)
        self._labels(self._probes, engine, "ok" if ok else "failed").inc()

    def detection(self, engine: str, cause: str, seconds: float) -> None:
        """Record how long a failure took to be declared after its first evidence."""
        self._labels(self._detection, engine, cause).observe(seconds)

    def set_log_lines_dropped(self, n: int) -> None:
        """Record how many log lines a stalled stderr reader cost so far."""
        self._log_dropped.set(n)

    def set_event_log_write_errors(self, n: int) -> None:
        """Record how many events the disk refused so far."""
        self._event_log_errors.set(n)

    def loop_iteration(self, seconds: float) -> None:
        """Record the duration of one main loop iteration."""
        self._loop.observe(seconds)

    def bad_control_message(self) -> None:
        """Count a rejected control message."""
        self._bad_control.inc()

    def link_bad_message(self, reason: str) -> None:
        """Count a frame (or connection) from the coordinator that the node link dropped."""
        self._link_bad.labels(reason).inc()

    def link_events_dropped(self) -> None:
        """Count an event dropped from the node link's full outbox."""
        self._link_dropped.inc()

    def set_link_state(self, outbox: int, connected: bool) -> None:
        """Record the node link's outbox length and whether the coordinator is there."""
        self._link_outbox.set(outbox)
        self._coordinator_connected.set(1 if connected else 0)

    def remove_engine(self, engine: str) -> None:
        """Drop every series of an engine that left the config, so no stale state lingers."""
        with self._lock:
            series = self._series.pop(engine, set())
        for metric, values in series:
            metric.remove(*values)

    def render(self) -> bytes:
        """The exposition text, as a scrape would return it."""
        return generate_latest(self.registry)
