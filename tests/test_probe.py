"""The deep probe's HTTP GET: what it reports for each way an engine can answer or not."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rollout_watchdog.watchdog.probe import Progress, http_get_ok, parse_progress


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path == "/hang":
            time.sleep(3)
        self.send_response(200 if self.path in ("/ok", "/hang") else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_200_passes(server: str) -> None:
    assert http_get_ok(server + "/ok", 2.0) == (True, "HTTP 200")


def test_503_fails_with_the_status(server: str) -> None:
    assert http_get_ok(server + "/health_generate", 2.0) == (False, "HTTP 503")


def test_no_answer_fails_within_the_timeout(server: str) -> None:
    started = time.monotonic()
    assert http_get_ok(server + "/hang", 0.5) == (False, "no answer within 0.5 s")
    assert time.monotonic() - started < 2.5


def test_nothing_listening_is_connection_refused() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert http_get_ok(f"http://127.0.0.1:{port}/x", 1.0) == (False, "connection refused")


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
