"""The emulator's HTTP layer: SGLang's routes on a stdlib threaded HTTP server.

Handlers are thin: they parse with :mod:`protocol`, act through the server (an
:class:`~rollout_watchdog.emulator.engine.Engine` plus its process), and answer with SGLang's
paths, bodies and status codes. A handler blocks exactly where SGLang blocks (paused requests,
control calls, a hung HTTP loop); every other wait is bounded.
"""

from __future__ import annotations

import json
import select
import socket
import socketserver
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlsplit

from rollout_watchdog.emulator import faults, protocol, weight_api
from rollout_watchdog.emulator.common import log
from rollout_watchdog.emulator.protocol import (
    FLUSH_CACHE_TEXT,
    MEMORY_TAGS,
    STARTING,
    UP,
    BadRequest,
    ClientGone,
    ReqState,
)

if TYPE_CHECKING:
    from rollout_watchdog.emulator.server import EmulatorServer

MAX_BODY_BYTES = 64 * 1024 * 1024
_FOREVER = threading.Event()  # never set: waited on by the hung HTTP loop (fault hang_http)

ROUTES: dict[str, tuple[frozenset[str], str]] = {
    "/health": (frozenset({"GET"}), "health"),
    "/health_generate": (frozenset({"GET"}), "health"),
    "/ready": (frozenset({"GET"}), "ready"),
    "/model_info": (frozenset({"GET"}), "model_info"),
    "/get_model_info": (frozenset({"GET"}), "model_info"),
    "/get_weight_version": (frozenset({"GET"}), "weight_version"),
    "/server_info": (frozenset({"GET"}), "server_info"),
    "/get_server_info": (frozenset({"GET"}), "server_info"),
    "/generate": (frozenset({"POST", "PUT"}), "generate"),
    "/pause_generation": (frozenset({"POST"}), "pause"),
    "/continue_generation": (frozenset({"POST"}), "continue"),
    "/release_memory_occupation": (frozenset({"GET", "POST"}), "release"),
    "/resume_memory_occupation": (frozenset({"GET", "POST"}), "resume"),
    "/flush_cache": (frozenset({"GET", "POST"}), "flush_cache"),
    "/abort_request": (frozenset({"POST"}), "abort_request"),
    "/update_weight_version": (frozenset({"POST"}), "update_weight_version"),
    **{path: (frozenset({"POST"}), "weights") for path in weight_api.OPS},
    "/metrics": (frozenset({"GET"}), "metrics"),
    "/v1/models": (frozenset({"GET"}), "models"),
    "/_emulator/info": (frozenset({"GET"}), "emu_info"),
    "/_emulator/fault": (frozenset({"POST"}), "emu_fault"),
}


class EmulatorHTTPServer(ThreadingHTTPServer):
    """Threaded HTTP server; quiet about client disconnects, no reverse DNS at bind."""

    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 128
    emu: EmulatorServer

    def server_bind(self) -> None:
        # HTTPServer.server_bind calls socket.getfqdn(), a DNS lookup that can stall start-up.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        log(f"HTTP error with {client_address}: {exc!r}")


class EmulatorHandler(BaseHTTPRequestHandler):
    """Routes requests to the engine; JSON bodies and status codes as SGLang's FastAPI app."""

    protocol_version = "HTTP/1.1"
    server_version = "uvicorn"
    sys_version = ""
    timeout = 600  # bounds body reads and idle keep-alive connections
    server: EmulatorHTTPServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - base signature
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server naming
        self._dispatch("GET")

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch("POST")

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch("PUT")

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:  # noqa: N802
        self._dispatch("PATCH")

    # ---- plumbing -------------------------------------------------------------------------

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """JSON instead of the base class's HTML error page (malformed requests)."""
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        self.close_connection = True
        self._send(code, json.dumps({"detail": message or phrase}).encode(),
                   headers={"Connection": "close"})

    def _send(
        self,
        code: int,
        body: bytes,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.send_response(code)
        if body or content_type != "application/json":
            self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)
        self._responded = True

    def _json(self, code: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(code, json.dumps(obj).encode(), headers=headers)

    def _empty(self, code: int) -> None:
        self._send(code, b"")

    def _bad_request(self, exc: BadRequest) -> None:
        if exc.validation:
            phrase = HTTPStatus(exc.code).phrase
            self._json(exc.code, {"object": "error", "message": exc.message, "type": phrase,
                                  "param": None, "code": exc.code})
        else:
            self._json(exc.code, {"error": {"message": exc.message}})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            chunks: list[bytes] = []
            total = 0
            while True:
                line = self.rfile.readline(1024)
                try:
                    size = int(line.split(b";")[0].strip() or b"x", 16)
                except ValueError:
                    raise BadRequest("malformed chunked body", True) from None
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                total += size
                if total > MAX_BODY_BYTES:
                    raise BadRequest("request body too large", True, code=413)
                chunks.append(self.rfile.read(size))
                self.rfile.readline(1024)
        length = self.headers.get("Content-Length")
        if length is None:
            return b""
        try:
            n = int(length)
        except ValueError:
            raise BadRequest("invalid Content-Length", True) from None
        if n < 0 or n > MAX_BODY_BYTES:
            raise BadRequest("request body too large", True, code=413)
        return self.rfile.read(n) if n else b""

    def _client_gone(self) -> bool:
        """True when the client closed its connection (EOF readable), like Starlette's
        request.is_disconnected()."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return bool(self.connection.recv(1, socket.MSG_PEEK) == b"")
        except (OSError, ValueError):
            return True

    def _dispatch(self, method: str) -> None:
        emu = self.server.emu
        if emu.hang_http:
            _FOREVER.wait()  # deliberately forever: a hung HTTP loop
        self._responded = False
        url = urlsplit(self.path)
        self.url_path = url.path
        self.query = parse_qs(url.query)
        try:
            body = self._read_body()
        except BadRequest as exc:
            self.close_connection = True
            self._bad_request(exc)
            return
        route = ROUTES.get(url.path)
        if (
            route is None
            or (url.path == "/metrics" and not emu.args.enable_metrics)
            or (url.path in weight_api.SESSION_PATHS and not emu.weight_session)
        ):
            self._json(404, {"detail": "Not Found"})
            return
        methods, name = route
        if method not in methods:
            self._json(405, {"detail": "Method Not Allowed"},
                       headers={"Allow": ", ".join(sorted(methods))})
            return
        try:
            getattr(self, "h_" + name)(emu, body)
        except BadRequest as exc:
            if not self._responded:
                self._bad_request(exc)
        except (ClientGone, ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as exc:  # noqa: BLE001 - never a traceback, always an answer
            log(f"internal error on {method} {url.path}: {exc!r}")
            self.close_connection = True
            if not self._responded:
                self._json(500, {"error": {"message": f"Internal server error: {exc}"}})

    # ---- handlers -------------------------------------------------------------------------

    def h_health(self, emu: EmulatorServer, body: bytes) -> None:
        if emu.gracefully_exit or emu.status == STARTING:
            self._empty(503)
            return
        if self.url_path == "/health" and not emu.health_generation:
            self._empty(200)
            return
        self._empty(200 if emu.health_check() else 503)

    def h_ready(self, emu: EmulatorServer, body: bytes) -> None:
        ok = emu.status == UP and not emu.is_pause and not emu.gracefully_exit
        self._empty(200 if ok else 503)

    def h_model_info(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, protocol.model_info(emu.args, emu.weight_version))

    def h_weight_version(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, {"weight_version": emu.weight_version})

    def h_server_info(self, emu: EmulatorServer, body: bytes) -> None:
        sched = emu.control("server_info")  # no timeout: never use /server_info as a probe
        internal = sched.pop("internal_states", [])
        self._json(200, {
            **emu.server_args(),
            **emu.scheduler_info,
            **sched,
            "internal_states": internal,
            "version": emu.args.sglang_version,
        })

    def h_generate(self, emu: EmulatorServer, body: bytes) -> None:
        obj = protocol.json_body(body)
        states, is_batch = protocol.parse_generate(obj)
        stream = bool(obj.get("stream", False))
        if stream and is_batch:
            raise BadRequest("streaming batch requests are not supported by the emulator")
        emu.register(states)
        with emu.lock:
            emu.responding += 1
        try:
            self._generate_registered(emu, states, is_batch, stream)
        finally:
            with emu.cond:
                emu.responding -= 1
                emu.cond.notify_all()

    def _generate_registered(
        self, emu: EmulatorServer, states: list[ReqState], is_batch: bool, stream: bool
    ) -> None:
        emu.pass_pause_gate_and_submit(states)
        try:
            if stream:
                self._stream(emu, states[0])
                return
            for state in states:
                while not state.done.wait(0.25):
                    if self._client_gone():
                        raise ClientGone()
        except (ClientGone, ConnectionError, TimeoutError):
            for state in states:
                if not state.done.is_set():
                    emu.abort(state.rid)
            raise
        outs = [emu.output(s) for s in states]
        self._json(200, outs if is_batch else outs[0])

    def _stream(self, emu: EmulatorServer, state: ReqState) -> None:
        """Server-sent events, one cumulative chunk per decode step, then [DONE]."""
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self._responded = True
        sent = -1
        while True:
            state.updated.wait(0.25)
            state.updated.clear()
            finished = state.done.is_set()
            with emu.lock:
                n = len(state.output_ids)
            if n != sent or finished:
                sent = n
                chunk = emu.output(state, finished=finished)
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if finished:
                break
            if self._client_gone():
                raise ClientGone()
        self.wfile.write(b"data: [DONE]\n\n")

    def h_pause(self, emu: EmulatorServer, body: bytes) -> None:
        emu.pause(protocol.parse_pause_mode(protocol.json_body(body)))
        self._json(200, {"message": "Generation paused successfully.", "status": "ok"})

    def h_continue(self, emu: EmulatorServer, body: bytes) -> None:
        protocol.json_body(body)
        emu.resume_generation()
        self._json(200, {"message": "Generation continued successfully.", "status": "ok"})

    def _memory_tags(self, emu: EmulatorServer, body: bytes, what: str) -> list[str] | None:
        obj = protocol.json_body(body)
        if not emu.args.enable_memory_saver:
            raise BadRequest(
                f"{what} requires the server to be started with --enable-memory-saver"
            )
        return protocol.parse_memory_tags(obj)

    def h_release(self, emu: EmulatorServer, body: bytes) -> None:
        tags = self._memory_tags(emu, body, "release_memory_occupation")
        emu.control("release", {"tags": tags})  # a busy scheduler dies here (server exits)
        with emu.lock:
            emu.memory_released.update(tags or MEMORY_TAGS)
        self._json(200, None)

    def h_resume(self, emu: EmulatorServer, body: bytes) -> None:
        tags = self._memory_tags(emu, body, "resume_memory_occupation")
        emu.control("resume", {"tags": tags})
        with emu.lock:
            emu.memory_released.difference_update(tags or MEMORY_TAGS)
        self._json(200, None)

    def h_flush_cache(self, emu: EmulatorServer, body: bytes) -> None:
        timeout = protocol.parse_flush_timeout(self.query)
        deadline = time.monotonic() + timeout
        while True:
            ok = bool(emu.control("flush_cache").get("success"))
            if ok or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        self._send(200 if ok else 400, FLUSH_CACHE_TEXT.encode(), "text/plain; charset=utf-8")

    def h_abort_request(self, emu: EmulatorServer, body: bytes) -> None:
        rid, abort_all = protocol.parse_abort(protocol.json_body(body))
        emu.abort(rid, abort_all)
        self._empty(200)

    def h_update_weight_version(self, emu: EmulatorServer, body: bytes) -> None:
        version, abort_all = protocol.parse_weight_version(protocol.json_body(body))
        emu.set_weight_version(version, abort_all)
        self._json(200, {"success": True, "message": f"Weight version updated to {version}",
                         "new_version": version})

    def h_weights(self, emu: EmulatorServer, body: bytes) -> None:
        """The weight-update endpoints: blocks until the scheduler finished (no timeout)."""
        code, answer = weight_api.handle(emu, self.url_path, protocol.json_body(body))
        self._json(code, answer)

    def h_metrics(self, emu: EmulatorServer, body: bytes) -> None:
        self._send(200, emu.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")

    def h_models(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, protocol.models_list(emu.served_model_name))

    def h_emu_info(self, emu: EmulatorServer, body: bytes) -> None:
        self._json(200, emu.info())

    def h_emu_fault(self, emu: EmulatorServer, body: bytes) -> None:
        obj = protocol.json_body(body)
        name = obj.get("fault")
        extra, post = faults.inject(emu, name, obj)
        self._json(200, {"ok": True, "fault": name, **extra})
        if post is not None:
            post()
