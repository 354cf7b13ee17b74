"""Prometheus metrics, scraped over real HTTP."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from enum import Enum

import pytest
import requests

from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.metrics import STATES, Metrics


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(metrics: Metrics, **kwargs: float) -> int:
    """Start the server on a free port; another process could take the port between the probe
    and the bind, so retry a few times."""
    for attempt in range(5):
        port = _free_port()
        try:
            metrics.start_server(port, **kwargs)  # type: ignore[arg-type]
            return port
        except OSError:
            if attempt == 4:
                raise
    raise AssertionError("unreachable")


@pytest.fixture
def served() -> Iterator[tuple[Metrics, str]]:
    metrics = Metrics()
    port = _start(metrics)
    yield metrics, f"http://127.0.0.1:{port}/metrics"
    metrics.stop_server()


def _scrape(url: str) -> dict[str, float]:
    """Samples by their full name with labels, e.g. 'x_total{engine="e0"}'."""
    resp = requests.get(url, timeout=10)
    resp.raise_for_status()
    samples: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def test_scrape(served: tuple[Metrics, str]) -> None:
    metrics, url = served
    metrics.set_state("e0", "starting")
    metrics.set_state("e0", "healthy")
    metrics.set_paused("e0", True)
    metrics.set_incarnation("e0", 3)
    metrics.restart("e0", "exited")
    metrics.restart("e0", "exited")
    metrics.kill("e0", "probe_failed", "SIGTERM")
    metrics.kill("e0", "probe_failed", "SIGKILL")
    metrics.probe("e0", 0.02, ok=True)
    metrics.probe("e0", 30.0, ok=False)
    metrics.detection("e0", "exited", 0.004)
    metrics.loop_iteration(0.0003)
    metrics.bad_control_message()

    s = _scrape(url)
    for state in STATES:
        expected = 1.0 if state == "healthy" else 0.0
        assert s[f'rollout_watchdog_engine_state{{engine="e0",state="{state}"}}'] == expected
    assert s['rollout_watchdog_engine_paused{engine="e0"}'] == 1.0
    assert s['rollout_watchdog_engine_incarnation{engine="e0"}'] == 3.0
    assert s['rollout_watchdog_restarts_total{cause="exited",engine="e0"}'] == 2.0
    assert s['rollout_watchdog_kills_total{cause="probe_failed",engine="e0",signal="SIGTERM"}'] == 1
    assert s['rollout_watchdog_kills_total{cause="probe_failed",engine="e0",signal="SIGKILL"}'] == 1
    assert s['rollout_watchdog_probes_total{engine="e0",result="ok"}'] == 1.0
    assert s['rollout_watchdog_probes_total{engine="e0",result="failed"}'] == 1.0
    assert s['rollout_watchdog_probe_latency_seconds_count{engine="e0"}'] == 2.0
    assert s['rollout_watchdog_probe_latency_seconds_sum{engine="e0"}'] == pytest.approx(30.02)
    assert s['rollout_watchdog_probe_latency_seconds_bucket{engine="e0",le="0.025"}'] == 1.0
    assert s['rollout_watchdog_probe_latency_seconds_bucket{engine="e0",le="+Inf"}'] == 2.0
    assert s['rollout_watchdog_detection_latency_seconds_count{cause="exited",engine="e0"}'] == 1
    assert s['rollout_watchdog_detection_latency_seconds_bucket{cause="exited",engine="e0",le="0.005"}'] == 1  # noqa: E501
    assert s["rollout_watchdog_loop_iteration_seconds_count"] == 1.0
    assert s["rollout_watchdog_bad_control_messages_total"] == 1.0

    metrics.set_paused("e0", False)
    metrics.set_state("e0", "backoff")
    s = _scrape(url)
    assert s['rollout_watchdog_engine_paused{engine="e0"}'] == 0.0
    assert s['rollout_watchdog_engine_state{engine="e0",state="backoff"}'] == 1.0
    assert s['rollout_watchdog_engine_state{engine="e0",state="healthy"}'] == 0.0


def test_remove_engine_drops_only_its_series() -> None:
    metrics = Metrics()
    for engine in ("e0", "e1"):
        metrics.set_state(engine, "healthy")
        metrics.set_paused(engine, False)
        metrics.set_incarnation(engine, 1)
        metrics.restart(engine, "exited")
        metrics.kill(engine, "exited", "SIGKILL")
        metrics.probe(engine, 0.1, ok=True)
        metrics.detection(engine, "exited", 0.01)
    metrics.remove_engine("e0")
    metrics.remove_engine("e0")  # idempotent
    text = metrics.render().decode()
    assert 'engine="e0"' not in text
    assert text.count('engine="e1"') > 10


def test_registry_is_private() -> None:
    """Two instances (two daemons in one test process) do not share or clash on series."""
    a, b = Metrics(), Metrics()
    a.restart("e0", "exited")
    assert b'rollout_watchdog_restarts_total{cause="exited",engine="e0"} 1.0' in a.render()
    assert b'engine="e0"' not in b.render()


def test_str_enums_label_by_value() -> None:
    class Cause(str, Enum):
        EXITED = "exited"

    class State(str, Enum):
        HEALTHY = "healthy"

    metrics = Metrics()
    metrics.restart("e0", Cause.EXITED)
    metrics.set_state("e0", State.HEALTHY)
    text = metrics.render().decode()
    assert 'rollout_watchdog_restarts_total{cause="exited",engine="e0"} 1.0' in text
    assert 'rollout_watchdog_engine_state{engine="e0",state="healthy"} 1.0' in text


def test_unknown_state_rejected() -> None:
    with pytest.raises(ValueError):
        Metrics().set_state("e0", "zombie")


def _threads() -> int:
    """Threads of this process, as the kernel counts them."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed this idle client connection (EOF or reset)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_idle_connections_cost_no_thread_and_a_scrape_gets_through() -> None:
    """300 idle connections: no thread each, at most 64 kept open, and a fresh scrape answers
    (by evicting the oldest, not once an idle one times out: 60 s here, so that waiting for
    it would be unmistakable)."""
    metrics = Metrics()
    metrics.set_state("e0", "healthy")
    port = _start(metrics, timeout_s=60.0)
    threads = _threads()
    clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(300)]
    try:
        assert _threads() <= threads
        started = time.monotonic()
        samples = _scrape(f"http://127.0.0.1:{port}/metrics")
        assert time.monotonic() - started < 30   # well before an idle connection's 60 s
        assert samples['rollout_watchdog_engine_state{engine="e0",state="healthy"}'] == 1
        closed: set[int] = set()

        def evicted() -> bool:
            closed.update(i for i, c in enumerate(clients) if i not in closed and _closed(c))
            return len(closed) >= 300 - 64
        wait_until(evicted, 30, what="the server to close all but 64 idle connections")
        assert _threads() <= threads
    finally:
        for client in clients:
            client.close()
        metrics.stop_server()


def test_idle_and_slow_connections_time_out() -> None:
    metrics = Metrics()
    port = _start(metrics, timeout_s=0.3)
    started = time.monotonic()   # before the connects: each timeout runs from its accept
    idle = socket.create_connection(("127.0.0.1", port), timeout=5)
    slow = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        slow.sendall(b"GET /metr")
        wait_until(lambda: _closed(idle) and _closed(slow), 5,
                   what="the server to close an idle and a slow connection")
        assert time.monotonic() - started >= 0.25  # closed by the timeout, not at once
    finally:
        idle.close()
        slow.close()
        metrics.stop_server()


def test_answers_other_requests_plainly(served: tuple[Metrics, str]) -> None:
    _, url = served
    base = url.rsplit("/", 1)[0]
    assert requests.get(f"{base}/other", timeout=5).status_code == 404
    assert requests.post(url, timeout=5).status_code == 405
    head = requests.head(url, timeout=5)
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["Content-Length"]) > 0
    assert requests.get(f"{url}?name[]=x", timeout=5).status_code == 200


def test_stop_server_releases_the_port() -> None:
    metrics = Metrics()
    port = _start(metrics)
    _scrape(f"http://127.0.0.1:{port}/metrics")  # leaves the server side in TIME_WAIT
    metrics.stop_server()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)
    again = Metrics()  # a daemon restarted in this process binds the same port
    again.start_server(port)
    try:
        _scrape(f"http://127.0.0.1:{port}/metrics")
    finally:
        again.stop_server()
