"""Prometheus metrics of the coordinator (`--metrics-port`; DESIGN.md, "Fleet").

The same library, registry-per-instance and HTTP server as the node daemon's metrics
(`common/metrics_server.py`). The coordinator's loop owns the fleet view and is not
thread-safe, so the loop takes a `FleetSample` (plain numbers) at most every `every_s` and the
server's thread renders the latest one; refit outcomes are observed as they happen.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rollout_watchdog.common.metrics_server import MetricsServer
from rollout_watchdog.common.states import EngineState
from rollout_watchdog.refit_bridge.queries import Hub

SAMPLE_EVERY_S = 1.0
REFIT_OUTCOMES = ("committed", "aborted", "expired", "released")
# A refit takes seconds (a small model, a broadcast) to many minutes (a large one).
_REFIT_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)


@dataclass(frozen=True)
class FleetSample:
    """What the coordinator's loop knows, as numbers, at one moment."""

    nodes_reachable: int = 0
    nodes_unreachable: int = 0
    engines_by_state: Mapping[str, int] = field(default_factory=dict)   # reachable nodes only
    serving: int = 0
    pending_weights: int = 0        # healthy, not serving: waiting for a refit to reach them
    current_version: str | None = None
    lock_holder: str | None = None
    lock_version: str | None = None
    lease_remaining_s: float = 0.0
    events_relayed: int = 0
    relay_skipped: int = 0
    bad_frames: Mapping[str, int] = field(default_factory=dict)
    handshakes_failed: Mapping[str, int] = field(default_factory=dict)   # by kind


def sample_of(hub: Hub, now: float) -> FleetSample:
    """The hub's numbers now: O(engines), taken by the loop at most once a `every_s`."""
    by_state: Counter[str] = Counter({state.value: 0 for state in EngineState})
    served = pending = reachable = 0
    book = hub.refit.book
    for node_id, record in hub.view.nodes.items():
        if not record.reachable:
            continue
        reachable += 1
        for engine in record.engines.values():
            state = str(engine.get("state"))
            by_state[state] += 1
            if book.serving(node_id, engine):
                served += 1
            elif state == EngineState.HEALTHY.value:
                pending += 1
    lease = hub.refit.lock.lease
    return FleetSample(
        nodes_reachable=reachable, nodes_unreachable=len(hub.view.nodes) - reachable,
        engines_by_state=dict(by_state), serving=served, pending_weights=pending,
        current_version=book.current,
        lock_holder=None if lease is None else lease.holder,
        lock_version=None if lease is None else lease.version,
        lease_remaining_s=0.0 if lease is None else max(0.0, lease.expires - now),
        events_relayed=hub.relay.end, relay_skipped=hub.relay.skipped_behind,
        bad_frames={**hub.bad_messages, **hub.view.refused},
        handshakes_failed=dict(hub.handshakes_failed))


class _SampleCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sample = FleetSample()

    def set(self, sample: FleetSample) -> None:
        with self._lock:
            self._sample = sample

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            s = self._sample
        nodes = GaugeMetricFamily("rollout_watchdog_fleet_nodes",
                                  "Nodes known to the coordinator, by reachability.",
                                  labels=["reachable"])
        nodes.add_metric(["true"], s.nodes_reachable)
        nodes.add_metric(["false"], s.nodes_unreachable)
        yield nodes
        engines = GaugeMetricFamily("rollout_watchdog_fleet_engines",
                                    "Engines of reachable nodes, by supervision state.",
                                    labels=["state"])
        for state, count in sorted(s.engines_by_state.items()):
            engines.add_metric([state], count)
        yield engines
        yield GaugeMetricFamily("rollout_watchdog_fleet_engines_serving",
                                "Engines in the router's set: healthy, with current weights.",
                                value=s.serving)
        yield GaugeMetricFamily("rollout_watchdog_fleet_engines_pending_weights",
                                "Healthy engines kept out of the router until a refit reaches "
                                "them.", value=s.pending_weights)
        version = GaugeMetricFamily("rollout_watchdog_fleet_weight_version",
                                    "1, labelled with the version the last committed refit "
                                    "set (none before the first).", labels=["version"])
        version.add_metric([s.current_version or ""], 1 if s.current_version else 0)
        yield version
        held = GaugeMetricFamily("rollout_watchdog_refit_lock_held",
                                 "1 while a trainer holds the refit lock, labelled with the "
                                 "holder and the version it refits to.",
                                 labels=["holder", "version"])
        held.add_metric([s.lock_holder or "", s.lock_version or ""],
                        1 if s.lock_holder else 0)
        yield held
        yield GaugeMetricFamily("rollout_watchdog_refit_lease_remaining_seconds",
                                "Seconds left on the refit lock's lease unless renewed "
                                "(0 when free).", value=s.lease_remaining_s)
        yield CounterMetricFamily("rollout_watchdog_fleet_events_relayed",
                                  "Node events relayed to subscribers since the start.",
                                  value=s.events_relayed)
        yield CounterMetricFamily("rollout_watchdog_fleet_relay_skipped",
                                  "Events a subscriber missed by falling behind the buffer.",
                                  value=s.relay_skipped)
        bad = CounterMetricFamily("rollout_watchdog_fleet_bad_frames",
                                  "Messages dropped or refused, by reason.", labels=["reason"])
        for reason, count in sorted(s.bad_frames.items()):
            bad.add_metric([reason], count)
        yield bad
        failed = CounterMetricFamily("rollout_watchdog_fleet_handshakes_failed",
                                     "Connections dropped before they finished the ZMTP/CURVE "
                                     "handshake, by kind: timeout, closed (by the peer), auth "
                                     "(a key not authorized), protocol.", labels=["kind"])
        for kind, count in sorted(s.handshakes_failed.items()):
            failed.add_metric([kind], count)
        yield failed


class CoordinatorMetrics:
    """The coordinator's registry, its sample, its refit observations and its server."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S) -> None:
        self.registry = CollectorRegistry()
        self.every_s = every_s
        self.next_sample = 0.0        # monotonic: when the loop takes the next sample
        self._sample = _SampleCollector()
        self.registry.register(self._sample)
        self._refit_seconds = Histogram(
            "rollout_watchdog_refit_duration_seconds",
            "Refits from lock taken to lock released, by outcome.",
            ["outcome"], buckets=_REFIT_BUCKETS, registry=self.registry)
        self._refits = PromCounter(
            "rollout_watchdog_refits", "Refits ended, by outcome: committed, aborted (by "
            "its trainer), expired (its lease ran out or its holder went silent), released "
            "(neither committed nor aborted).", ["outcome"], registry=self.registry)
        for outcome in REFIT_OUTCOMES:   # every series exists from the start (rate() works)
            self._refits.labels(outcome)
            self._refit_seconds.labels(outcome)
        self._server: MetricsServer | None = None

    def sample(self, hub: Hub, now: float) -> None:
        """Take the hub's numbers if `every_s` has passed since the last time."""
        if now >= self.next_sample:
            self._sample.set(sample_of(hub, now))
            self.next_sample = now + self.every_s

    def refit_ended(self, outcome: str, duration_s: float) -> None:
        self._refits.labels(outcome).inc()
        self._refit_seconds.labels(outcome).observe(max(0.0, duration_s))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_server(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics; the port bound (`port` 0 picks one). OSError if it is taken."""
        self.stop_server()
        server = MetricsServer(self.render, host, port)
        server.start()
        self._server = server
        return server.port

    def stop_server(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = None
