"""The deep probe against real HTTP servers on 127.0.0.1: what it reports for each way an engine
can answer or not, and that no engine (trickling, silent, garbage) holds a probe thread past the
probe's deadline or delays the probes of others."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rollout_watchdog.emulator.testing import wait_until
from rollout_watchdog.watchdog.probe import (
    ProbeResult,
    ProbeRunner,
    Progress,
    parse_progress,
    printable,
)

METRICS = b"""sglang:generation_tokens_total{model_name="m"} 42.0
sglang:num_running_reqs{model_name="m"} 1.0
"""
GARBAGE = bytes(b for b in range(256) if b != 10) * 4 + b"\r\n"  # one long status line
TRICKLES = {"started": 0, "open": 0}  # the server's trickling connections


def _response(status: int, body: bytes = b"") -> bytes:
    return (f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            .encode() + body)


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """One connection, by path: /ok /503 /metrics answer; /split-metrics answers 200 KB of
    metrics 0.2 s after its headers; /trickle sends a byte every 0.2 s and never a status line;
    /silent never answers; /garbage answers binary garbage; /slow?S waits S seconds, then
    answers 200 (with metrics)."""
    try:
        path = (await reader.readuntil(b"\r\n\r\n")).split(b" ", 2)[1].decode()
        if path == "/trickle":
            await _trickle(writer)
        elif path == "/silent":
            await reader.read()  # until the client gives up
        elif path == "/garbage":
            writer.write(GARBAGE)
        elif path == "/split-metrics":   # a real engine's /metrics: big, after its headers
            body = METRICS + b"# padding\n" * 20_000
            head = _response(200, body)[: -len(body)]
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(body)
        elif path.startswith("/slow?"):
            await asyncio.sleep(float(path.split("?", 1)[1]))
            writer.write(_response(200, METRICS))
        else:
            writer.write(_response({"/ok": 200, "/metrics": 200}.get(path, 503), METRICS))
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the probe gave up
    finally:
        writer.close()


async def _trickle(writer: asyncio.StreamWriter) -> None:
    """A byte every 0.2 s, until the client closes its socket (the write then fails)."""
    TRICKLES["started"] += 1
    TRICKLES["open"] += 1
    try:
        while True:
            writer.write(b"x")
            await writer.drain()
            await asyncio.sleep(0.2)
    finally:
        TRICKLES["open"] -= 1


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The engines' server: one asyncio thread, so the thread count only moves with probes."""
    loop = asyncio.new_event_loop()
    srv = loop.run_until_complete(asyncio.start_server(_serve, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    srv.close()
    tasks = asyncio.all_tasks(loop)
    for task in tasks:
        task.cancel()
    if tasks:   # (gather() of nothing makes its future on another loop: ValueError here)
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    loop.close()


@pytest.fixture
def runner(server: str) -> Iterator[ProbeRunner]:
    """A runner; on teardown, every probe thread it started must have ended."""
    baseline = threading.active_count()
    probes = ProbeRunner()
    yield probes
    probes.close()
    wait_until(lambda: threading.active_count() <= baseline, 10,
               what=f"thread count back to {baseline} (now {threading.active_count()})")


def result_of(runner: ProbeRunner, limit_s: float = 5.0) -> ProbeResult:
    """The one result of the one probe out, waited for with a bound."""
    results = wait_until(runner.drain, limit_s, interval=0.01, what="the probe's result")
    assert len(results) == 1, results
    return results[0]


def probe(runner: ProbeRunner, url: str, timeout_s: float = 2.0,
          progress_url: str | None = None) -> ProbeResult:
    assert runner.submit("e", 1, url, timeout_s, progress_url)
    return result_of(runner, timeout_s + 10)


def test_200_passes(runner: ProbeRunner, server: str) -> None:
    result = probe(runner, server + "/ok")
    assert (result.engine, result.probe_id, result.ok, result.detail) == ("e", 1, True, "HTTP 200")
    assert result.progress is None


def test_503_fails_with_the_status(runner: ProbeRunner, server: str) -> None:
    result = probe(runner, server + "/health_generate")
    assert (result.ok, result.detail) == (False, "HTTP 503")


def test_nothing_listening_is_connection_refused(runner: ProbeRunner) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = probe(runner, f"http://127.0.0.1:{port}/x")
    assert (result.ok, result.detail) == (False, "connection refused")


def test_a_server_that_never_answers_fails_at_the_deadline(runner: ProbeRunner,
                                                           server: str) -> None:
    result = probe(runner, server + "/silent", 0.5)
    assert (result.ok, result.detail) == (False, "no answer within 0.5 s")
    assert result.finished - result.started >= 0.5   # (and it ended: `probe` waits with a bound)


def test_a_trickling_engine_is_cut_off_at_the_deadline(runner: ProbeRunner, server: str) -> None:
    """A byte every 0.2 s and never a status line: the timeout bounds the whole probe, not each
    read; its socket is closed and its worker is free for the next probe."""
    baseline, trickles = threading.active_count(), TRICKLES["open"]
    assert runner.submit("e", 1, server + "/trickle", 1.0)
    assert threading.active_count() == baseline + 1
    result = result_of(runner, 30)   # 1 s per read would never end: the trickle goes on
    assert (result.ok, result.detail) == (False, "no answer within 1 s")
    wait_until(lambda: TRICKLES["open"] == trickles, 10, what="the server to see the socket close")
    assert runner.submit("e", 2, server + "/ok", 1.0)  # the same worker takes the next one
    assert result_of(runner).ok
    assert threading.active_count() == baseline + 1


def test_expire_ends_a_probe_at_once(runner: ProbeRunner, server: str) -> None:
    """The loop's `expire` shuts the socket down: the blocked read returns without waiting for
    the thread's own deadline (here 30 s away; `now` is moved past it)."""
    started = TRICKLES["started"]
    assert runner.submit("e", 1, server + "/trickle", 30.0)
    deadline = runner.next_deadline()
    assert deadline is not None
    wait_until(lambda: TRICKLES["started"] > started, 10, what="the probe's request")
    runner.expire(time.monotonic())  # not yet due: nothing happens
    assert runner.in_flight("e") and runner.next_deadline() == deadline
    runner.expire(deadline)
    assert runner.next_deadline() is None  # expired probes no longer wake the loop
    result = result_of(runner, 1.0)
    assert (result.ok, result.detail) == (False, "no answer within 30 s")
    assert not runner.in_flight("e")


def test_one_probe_per_engine(runner: ProbeRunner, server: str) -> None:
    assert not runner.in_flight("e") and runner.next_deadline() is None
    before = time.monotonic()
    assert runner.submit("e", 1, server + "/silent", 0.5)
    assert runner.in_flight("e")
    assert before + 0.5 <= (runner.next_deadline() or 0) <= time.monotonic() + 0.5
    assert not runner.submit("e", 2, server + "/ok", 0.5), "a second probe of a busy engine"
    assert runner.submit("f", 3, server + "/ok", 0.5), "another engine is not held up"
    results = wait_until(lambda: [r for r in runner.drain() if r.engine == "e"], 10)
    assert [r.probe_id for r in results] == [1]
    assert not runner.in_flight("e")
    assert runner.submit("e", 4, server + "/ok", 0.5), "free again once its result is posted"


def test_max_workers_bounds_the_probes_in_flight(server: str) -> None:
    probes = ProbeRunner(max_workers=1)
    try:
        assert probes.submit("e", 1, server + "/silent", 0.3)
        assert not probes.submit("f", 2, server + "/ok", 0.3)
    finally:
        probes.close()
    with pytest.raises(ValueError, match="max_workers"):
        ProbeRunner(max_workers=0)


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_timeout_that_cannot_bound_a_probe_is_refused(runner: ProbeRunner, server: str,
                                                        timeout_s: float) -> None:
    with pytest.raises(ValueError, match="probe timeout must be a finite number"):
        runner.submit("e", 1, server + "/ok", timeout_s)
    assert not runner.in_flight("e")


def test_trickling_engines_do_not_starve_a_healthy_one(runner: ProbeRunner, server: str) -> None:
    """Six tricklers and a healthy engine, each probed again once its last probe ended, as the
    daemon's loop does, until the tricklers were each cut off at least once: the healthy
    engine passes every time, well before a trickler's deadline (2 s; waiting behind one would
    take that long), and the threads never outnumber the engines (plus one ending)."""
    baseline = threading.active_count()
    urls = {f"t{i}": server + "/trickle" for i in range(6)} | {"ok": server + "/ok"}
    ids = iter(range(1, 10**6))
    healthy: list[ProbeResult] = []
    cut_off = 0
    peak = 0

    def turn() -> bool:
        nonlocal cut_off, peak
        for engine, url in urls.items():
            if not runner.in_flight(engine):
                assert runner.submit(engine, next(ids), url, 2.0)
        peak = max(peak, threading.active_count() - baseline)
        runner.expire(time.monotonic())
        for result in runner.drain():
            if result.engine == "ok":
                healthy.append(result)
            else:
                assert (result.ok, result.detail) == (False, "no answer within 2 s")
                cut_off += 1
        return len(healthy) >= 10 and cut_off >= 6
    wait_until(turn, 60, interval=0.05, what="10 healthy probes and 6 tricklers cut off")
    assert all(r.ok for r in healthy), healthy
    # as a rule (one probe may meet a stall of a loaded host; none failed above)
    times = sorted(r.finished - r.started for r in healthy)
    assert times[len(times) // 2] < 1.0, times
    assert peak <= len(urls) + 1


def test_the_progress_get_counts_against_the_same_deadline(runner: ProbeRunner,
                                                          server: str) -> None:
    """Progress then health: each 0.4 s, together past a 0.6 s deadline."""
    result = probe(runner, server + "/slow?0.4", 0.6, progress_url=server + "/slow?0.4")
    # (with a deadline each, both would pass: 0.4 s is within 0.6 s)
    assert (result.ok, result.detail) == (False, "no answer within 0.6 s")
    result = probe(runner, server + "/ok", 0.5, progress_url=server + "/trickle")
    assert (result.ok, result.detail) == (False,
                                          "no answer within 0.5 s (during the progress probe)")


def test_progress_comes_with_the_result(runner: ProbeRunner, server: str) -> None:
    result = probe(runner, server + "/ok", progress_url=server + "/metrics")
    assert (result.ok, result.progress) == (True, Progress(tokens=42.0, running=1.0))
    result = probe(runner, server + "/ok", progress_url=server + "/404")
    assert (result.ok, result.progress) == (True, None)  # no metrics: no verdict, no failure


def test_a_body_sent_apart_from_its_headers_is_read(runner: ProbeRunner, server: str) -> None:
    """An SGLang /metrics is bigger than one buffer, and may come after its headers: it was
    read from a socket http.client had already closed ("Bad file descriptor"), so the
    progress probe saw nothing and no stall could ever be found."""
    result = probe(runner, server + "/ok", timeout_s=10.0,
                   progress_url=server + "/split-metrics")
    assert (result.ok, result.progress) == (True, Progress(tokens=42.0, running=1.0))


def test_garbage_answer_detail_is_escaped_and_trimmed(runner: ProbeRunner, server: str) -> None:
    result = probe(runner, server + "/garbage")
    assert not result.ok and result.detail.startswith("probe error: ")
    assert len(result.detail) == 200 and result.detail.endswith("...")
    assert result.detail.isascii() and result.detail.isprintable(), result.detail
    assert "\\x00\\x01" in result.detail
    assert printable("a\x1b[2J\u202eb\n") == "a\\x1b[2J\\u202eb\\n"


def test_close_aborts_probes_in_flight(server: str) -> None:
    baseline = threading.active_count()
    probes = ProbeRunner()
    for i in range(5):
        assert probes.submit(f"e{i}", i, server + ("/trickle" if i % 2 else "/silent"), 30.0)
    wait_until(lambda: threading.active_count() == baseline + 5, 10)
    started = time.monotonic()
    probes.close()
    assert time.monotonic() - started < 15   # well before the probes' 30 s
    wait_until(lambda: threading.active_count() == baseline, 10)
    assert sorted(r.probe_id for r in drain_queue(probes)) == list(range(5))
    assert not probes.submit("e0", 9, server + "/ok", 1.0)


def drain_queue(probes: ProbeRunner) -> list[ProbeResult]:
    """Results left in the queue after close (the wake-up pipe is gone then)."""
    out = []
    while not probes.results.empty():
        out.append(probes.results.get_nowait())
    return out


def test_progress_is_read_from_prometheus_text() -> None:
    text = """# HELP sglang:generation_tokens_total Number of generation tokens processed.
# TYPE sglang:generation_tokens_total counter
sglang:generation_tokens_total{model_name="m",dp_rank="0"} 100.0
sglang:generation_tokens_total{model_name="m",dp_rank="1"} 23.0
sglang:num_running_reqs{model_name="m",tp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 7.0
"""
    assert parse_progress(text) == Progress(tokens=123.0, running=2.0)
    assert parse_progress("sglang:num_running_reqs 1.0\n") is None  # no counter: no verdict

