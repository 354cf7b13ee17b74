"""Real-process fleet tests: a coordinator and node daemons, each a separate process; a client
connection that speaks the fleet protocol (docs/protocol.md); and a TCP relay that can pause a
link (a network blip: connections stay open, no byte moves) or cut it (connections reset).

The node side is `daemon_harness.Node` with a `coordinator` in its config; nothing here
duplicates it."""

from __future__ import annotations

import contextlib
import os
import queue
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from daemon_harness import EngineSpec, Node, wait_for

from rollout_watchdog.common import protocol
from rollout_watchdog.common.keys import ClientKeys

# ---------------------------------------------------------------------- the TCP relay


@dataclass(eq=False)
class _Side:
    """One socket of a relayed connection; `out` holds the bytes waiting to be written to it."""

    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    mask: int = 0
    peer: _Side | None = None


class TcpRelay:
    """Forwards TCP connections from 127.0.0.1:`listen_port` (0: any free port) to `target`.

    One thread with a selector. `pause()` stops moving bytes both ways and keeps every
    connection open (a network blip: nothing arrives, nothing fails); `resume()` moves them
    again, buffered bytes first; `cut()` resets every connection. Bounded: at most
    `max_connections` at once (more are closed at accept), at most `buffer_bytes` buffered per
    direction (reading stops until the other side drains).
    """

    def __init__(self, listen_port: int = 0, target: tuple[str, int] = ("127.0.0.1", 0), *,
                 max_connections: int = 64, buffer_bytes: int = 1 << 20,
                 connect_timeout_s: float = 2.0, call_timeout_s: float = 5.0) -> None:
        if not 0 < target[1] < 65536:
            raise ValueError(f"TcpRelay: target port must be 1..65535, got {target[1]}")
        self.target = target
        self.max_connections, self.buffer_bytes = max_connections, buffer_bytes
        self.connect_timeout_s, self.call_timeout_s = connect_timeout_s, call_timeout_s
        self.paused = False
        self.accepted = 0             # connections accepted so far (a reconnect adds one)
        self._sides: set[_Side] = set()
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = \
            queue.SimpleQueue()
        self._stopping = False
        self._listener = socket.create_server(("127.0.0.1", listen_port))
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"tcp-relay-{self.port}",
                                        daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def connections(self) -> int:
        """Relayed connections open now."""
        return len(self._sides) // 2

    def pause(self) -> None:
        """From its return on, no byte moves either way until `resume()`."""
        self._call(lambda: self._set_paused(True))

    def resume(self) -> None:
        self._call(lambda: self._set_paused(False))

    def cut(self) -> None:
        """Reset every open connection (RST both ways); new ones are accepted as before."""
        self._call(self._cut)

    def close(self) -> None:
        if self._thread.is_alive():
            self._call(self._stop)
            self._thread.join(self.call_timeout_s)
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()
        self._sel.close()

    def __enter__(self) -> TcpRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # the relay thread's own work; other threads ask for it through _call

    def _call(self, fn: Callable[[], None]) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"TcpRelay on port {self.port}: its thread is not running")
        done = threading.Event()
        self._calls.put((fn, done))
        self._wake_w.send(b"x")
        if not done.wait(self.call_timeout_s):
            raise RuntimeError(f"TcpRelay on port {self.port}: no answer from its thread "
                               f"within {self.call_timeout_s:g} s")

    def _run(self) -> None:
        while not self._stopping:
            for key, mask in self._sel.select(timeout=1.0):
                if key.data == "accept":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                elif key.data in self._sides:  # not closed by an earlier event of this round
                    self._io(key.data, mask)
            while not self._calls.empty():
                fn, done = self._calls.get()
                fn()
                done.set()
            for side in list(self._sides):
                self._update(side)
        for side in list(self._sides):
            self._close(side, reset=True)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.accepted += 1
        if self.connections >= self.max_connections:
            client.close()
            return
        try:
            server = socket.create_connection(self.target, timeout=self.connect_timeout_s)
        except OSError:  # as if the target refused: the client sees its connection close
            client.close()
            return
        a, b = _Side(client), _Side(server)
        a.peer, b.peer = b, a
        for side in (a, b):
            side.sock.setblocking(False)
            side.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sides.add(side)

    def _io(self, side: _Side, mask: int) -> None:
        assert side.peer is not None
        try:
            if mask & selectors.EVENT_READ:
                data = side.sock.recv(65536)
                if not data:
                    self._close(side, reset=False)
                    return
                side.peer.out += data
            if mask & selectors.EVENT_WRITE and side.out:
                del side.out[:side.sock.send(side.out)]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close(side, reset=True)

    def _update(self, side: _Side) -> None:
        """Select on what this side can do now: nothing while paused; read while its peer's
        buffer has room; write while it has bytes waiting."""
        assert side.peer is not None
        want = 0
        if not self.paused:
            if len(side.peer.out) < self.buffer_bytes:
                want |= selectors.EVENT_READ
            if side.out:
                want |= selectors.EVENT_WRITE
        if want == side.mask:
            return
        if side.mask == 0:
            self._sel.register(side.sock, want, side)
        elif want == 0:
            self._sel.unregister(side.sock)
        else:
            self._sel.modify(side.sock, want, side)
        side.mask = want

    def _close(self, side: _Side, *, reset: bool) -> None:
        for s in (side, side.peer):
            if s is None or s not in self._sides:
                continue
            self._sides.discard(s)
            if s.mask:
                self._sel.unregister(s.sock)
            if reset:  # SO_LINGER 0: close sends RST, as a dropped link would end
                with contextlib.suppress(OSError):
                    s.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                      (1).to_bytes(4, "little") + (0).to_bytes(4, "little"))
            s.sock.close()

    def _set_paused(self, paused: bool) -> None:
        self.paused = paused

    def _cut(self) -> None:
        for side in list(self._sides):
            self._close(side, reset=True)

    def _stop(self) -> None:
        self._stopping = True


# ---------------------------------------------------------------------- a client connection


class CoordinatorConnection:
    """A client's DEALER to the coordinator (CURVE when `key` and `coordinator_key` name
    pyzmq certificate files). Messages that arrive while `call` waits for its reply (events,
    heartbeats) are kept in `backlog`, bounded."""

    def __init__(self, endpoint: str, *, key: str | os.PathLike[str] | None = None,
                 coordinator_key: str | os.PathLike[str] | None = None,
                 backlog: int = 100_000) -> None:
        self.endpoint = endpoint
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        if key is not None and coordinator_key is not None:
            ClientKeys.load(key, coordinator_key).apply(self.socket)
        self.socket.connect(endpoint)
        self.backlog: deque[protocol.Message] = deque(maxlen=backlog)

    def send(self, message: protocol.Message) -> None:
        self.socket.send(protocol.encode(message))

    def recv(self, timeout_s: float) -> protocol.Message | None:
        """The next message within `timeout_s`, or None."""
        if not self.socket.poll(int(timeout_s * 1000)):
            return None
        return protocol.decode(self.socket.recv())

    def call(self, cmd: str, args: dict[str, Any] | None = None, *, node: str | None = None,
             engine: str | None = None, timeout_s: float = 5.0,
             gather_s: float | None = None) -> protocol.Reply:
        """Send one command; its reply. `gather_s` is the command's own `timeout_s` (how long
        the coordinator gathers node replies); TimeoutError if no reply within `timeout_s`."""
        request_id = uuid.uuid4().hex
        self.send(protocol.Command(request_id, cmd, args or {}, node=node, engine=engine,
                                   timeout_s=gather_s))
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.recv(left)
            if isinstance(message, protocol.Reply) and message.request_id == request_id:
                return message
            if message is not None:
                self.backlog.append(message)
        raise TimeoutError(f"no reply to {cmd!r} from the coordinator at {self.endpoint} "
                           f"within {timeout_s:g} s")

    def result(self, cmd: str, args: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        """`call`, asserting an "ok" reply; its result."""
        reply = self.call(cmd, args, **kwargs)
        assert reply.status == "ok", f"{cmd}: {reply.reason}"
        return reply.result

    def close(self) -> None:
        self.socket.close(linger=0)
        self.ctx.term()


# ---------------------------------------------------------------------- processes

def coordinator_command(bind: str, extra_args: Sequence[str] = ()) -> list[str]:
    """argv of a standalone coordinator: `python -m rollout_watchdog coordinator`."""
    return [sys.executable, "-m", "rollout_watchdog", "coordinator", "--bind", bind,
            *extra_args]


class CoordinatorProcess:
    """A coordinator running as its own process, bound to a fixed endpoint."""

    def __init__(self, proc: subprocess.Popen[bytes], endpoint: str, *,
                 key: str | os.PathLike[str] | None = None,
                 coordinator_key: str | os.PathLike[str] | None = None,
                 log_path: Path | None = None) -> None:
        self.proc, self.endpoint, self.log_path = proc, endpoint, log_path
        self.key, self.coordinator_key = key, coordinator_key

    def connect(self) -> CoordinatorConnection:
        """A fresh client connection (the caller closes it)."""
        return CoordinatorConnection(self.endpoint, key=self.key,
                                     coordinator_key=self.coordinator_key)

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             **kwargs: Any) -> protocol.Reply:
        """One command on a fresh connection."""
        conn = self.connect()
        try:
            return conn.call(cmd, args, **kwargs)
        finally:
            conn.close()

    def status(self, timeout_s: float = 5.0) -> dict[str, Any]:
        reply = self.call("status", timeout_s=timeout_s)
        assert reply.status == "ok", f"status: {reply.reason}"
        return dict(reply.result)

    def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """Until it answers `ping` (its result); AssertionError naming why not."""
        def ping() -> dict[str, Any] | None:
            code = self.proc.poll()
            if code is not None:
                raise AssertionError(f"the coordinator exited with {code} before answering "
                                     f"ping{self._log_tail()}")
            try:
                reply = self.call("ping", timeout_s=0.5)
            except TimeoutError:
                return None
            return dict(reply.result) if reply.status == "ok" else None
        return wait_for(ping, timeout_s, f"the coordinator at {self.endpoint} to answer ping",
                        interval=0.05)

    def kill(self) -> None:
        """SIGKILL: nothing is saved, nothing is said to anyone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)

    def cleanup(self) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop(timeout_s=5.0)
        self.kill()

    def _log_tail(self) -> str:
        if self.log_path is None:
            return ""
        with contextlib.suppress(OSError):
            lines = self.log_path.read_text(errors="replace").splitlines()[-20:]
            return ":\n  " + "\n  ".join(lines)
        return ""


def start_coordinator_process(bind: str, extra_args: Sequence[str] = (), *,
                              key: str | os.PathLike[str] | None = None,
                              coordinator_key: str | os.PathLike[str] | None = None,
                              log_path: Path | None = None, env: dict[str, str] | None = None,
                              ready_timeout_s: float = 15.0, wrap: Sequence[str] = ()
                              ) -> CoordinatorProcess:
    """Start `rollout-watchdog coordinator --bind BIND EXTRA_ARGS...` as its own process and
    wait (bounded) until it answers `ping`. `bind` names its port (not 0: a restart must find
    it again). `key`/`coordinator_key` are the client keys the readiness ping uses under CURVE.
    Its output goes to `log_path`, or is inherited; `wrap` is an argv prefix (`fd_limit`)."""
    port = bind.rsplit(":", 1)[-1]
    if not port.isdigit() or int(port) == 0:
        raise ValueError(f"start_coordinator_process: bind needs a fixed port, got {bind!r}")
    endpoint = bind.replace("0.0.0.0", "127.0.0.1").replace("*", "127.0.0.1")
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "ab")) if log_path is not None else None
        proc = subprocess.Popen([*wrap, *coordinator_command(bind, extra_args)], stdout=log,
                                stderr=subprocess.STDOUT if log else None,
                                env={**os.environ, **(env or {})})
    coordinator = CoordinatorProcess(proc, endpoint, key=key, coordinator_key=coordinator_key,
                                     log_path=log_path)
    try:
        coordinator.wait_ready(ready_timeout_s)
    except BaseException:
        coordinator.kill()
        raise
    return coordinator


def start_node_process(node_id: str, coordinator_endpoint: str, tmp_path: Path,
                       engines: int | list[EngineSpec] = 1, *,
                       key: str | os.PathLike[str] | None = None,
                       coordinator_key: str | os.PathLike[str] | None = None,
                       **node_kwargs: Any) -> Node:
    """A node daemon (`rollout-watchdog run --config`, its own process) named `node_id`, over
    `engines` emulator engines (a count: e0..eN-1), linked to the coordinator at
    `coordinator_endpoint` (CURVE with `key` and `coordinator_key`). Its files are in
    `tmp_path/node_id`; `node_kwargs` go to `daemon_harness.Node` (probe, restart, top, env).
    Started and answering on its control socket; the caller cleans it up (`Node.cleanup`)."""
    specs = engines if isinstance(engines, list) else [EngineSpec(f"e{i}")
                                                       for i in range(engines)]
    top = dict(node_kwargs.pop("top", None) or {})
    top["coordinator"] = coordinator_endpoint
    if key is not None or coordinator_key is not None:
        top.update(key=str(key), coordinator_key=str(coordinator_key))
    node = Node(tmp_path / node_id, specs, top=top, node_id=node_id, **node_kwargs)
    try:
        node.start()
    except BaseException:
        node.cleanup()
        raise
    return node
