"""WeightUpdateGroup against real engine-side processes over gloo on 127.0.0.1.

The peers are processes, each an HTTP server with SGLang's weight-update endpoints (0.5.21+
session rules, or the old kind without begin/end) whose handlers really join the group and
receive the broadcasts, plus the faults a refit must survive: a call accepted and then never
joining the collective (wedged, alive), and a SIGKILL while the trainer broadcasts. They are
forked from a `forkserver` that has imported torch and what the peer uses: one import of torch
a test worker, not one a peer (~3 s of CPU each).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rollout_watchdog.emulator.model import build_model  # noqa: E402
from rollout_watchdog.emulator.testing import (  # noqa: E402
    free_port,
    http_request,
    inject_fault,
    start_emulator,
    stop_emulator,
    wait_until,
)
from rollout_watchdog.refit_bridge.group import WeightUpdateGroup  # noqa: E402
from rollout_watchdog.refit_bridge.group_member import (  # noqa: E402
    GroupAborted,
    GroupMember,
    GroupMemberFailed,
)

BIG = 8 << 20  # floats: 32 MiB, more than the socket buffers hold, so a stalled peer blocks rank 0


# ---- the peer (a forked process) ---------------------------------------------------------

def _peer_main(version: str, fault: str, out: Connection) -> None:  # pragma: no cover - the peer
    """The peer: says "port N" once it serves, "in-init" and "in-update" as it enters them."""
    import datetime
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import torch.distributed as dist

    from rollout_watchdog.common.torch_group import (
        destroy_process_group,
        init_custom_process_group,
    )
    from rollout_watchdog.refit_bridge.engine_calls import uses_session

    groups: dict[str, Any] = {}
    state: dict[str, Any] = {"weights": {}, "version": "initial", "session": False}
    session_server = uses_session(version)

    def init(body: dict[str, Any]) -> tuple[int, str]:
        if fault == "stall_init":
            out.send("in-init")
            time.sleep(3600)
        try:
            groups[body["group_name"]] = init_custom_process_group(
                body["backend"], f"tcp://{body['master_address']}:{body['master_port']}",
                datetime.timedelta(seconds=60), body["world_size"], body["rank_offset"],
                body["group_name"])
        except Exception as exc:  # noqa: BLE001
            return 400, f"Failed to initialize custom process group: {exc}."
        return 200, "Succeeded to initialize custom process group."

    def update(body: dict[str, Any]) -> tuple[int, str]:
        if session_server and not state["session"]:
            return 400, "update_weights_from_distributed requires begin_weight_update"
        out.send("in-update")
        if fault == "stall_update":
            time.sleep(3600)
        pg = groups[body["group_name"]]
        empties = [torch.empty(s, dtype=getattr(torch, d))
                   for d, s in zip(body["dtypes"], body["shapes"], strict=True)]
        try:
            if body["load_format"] == "flattened_bucket":
                flat = torch.cat([t.flatten().view(torch.uint8) for t in empties])
                dist.broadcast(flat, src=0, group=pg)
                start = 0
                for t in empties:
                    size = t.numel() * t.element_size()
                    t.copy_(flat[start:start + size].clone().view(t.dtype).view(t.shape))
                    start += size
            else:
                for w in [dist.broadcast(t, src=0, group=pg, async_op=True) for t in empties]:
                    w.wait()
        except Exception as exc:  # noqa: BLE001
            return 400, f"Failed to update parameter online: {exc}. partially updated."
        state["weights"].update(zip(body["names"], empties, strict=True))
        if body.get("weight_version") is not None:
            state["version"] = body["weight_version"]
        return 200, "Succeeded to update parameter online."

    def destroy(body: dict[str, Any]) -> tuple[int, str]:
        pg = groups.pop(body["group_name"], None)
        if pg is None:
            return 400, "The group to be destroyed does not exist."
        destroy_process_group(pg)
        return 200, "Succeeded to destroy custom process group."

    def session(on: bool) -> Callable[[dict[str, Any]], tuple[int, str]]:
        def run(_body: dict[str, Any]) -> tuple[int, str]:
            state["session"] = on
            return 200, "ok"
        return run

    posts: dict[str, Callable[[dict[str, Any]], tuple[int, str]]] = {
        "/init_weights_update_group": init, "/update_weights_from_distributed": update,
        "/destroy_weights_update_group": destroy}
    if session_server:
        posts.update({"/begin_weight_update": session(True), "/end_weight_update": session(False)})

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self, code: int, obj: dict[str, Any]) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/server_info":
                self._answer(200, {"version": version, "tp_size": 1})
            elif self.path == "/model_info":
                self._answer(200, {"weight_version": state["version"], "groups": sorted(groups),
                                   "weights": {n: t.tolist() for n, t in state["weights"].items()
                                               if t.numel() <= 64}})
            else:
                self._answer(404, {"detail": "Not Found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path not in posts:
                self._answer(404, {"detail": "Not Found"})
                return
            code, message = posts[self.path](body)
            self._answer(code, {"success": code == 200, "message": message})

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    out.send(f"port {server.server_address[1]}")
    server.serve_forever()


# ---- test helpers ---------------------------------------------------------------------

# Preloaded: the forkserver imports them once, so that a peer starts with them imported. By
# name, not this module's: before Python 3.12.8 the forkserver does not take the parent's
# sys.path (CPython gh-117378), so each peer imports this module itself, cheaply then.
_PEERS = multiprocessing.get_context("forkserver")
_PEERS.set_forkserver_preload([
    "torch", "torch.distributed", "pytest", "http.server", "rollout_watchdog.emulator.model",
    "rollout_watchdog.emulator.testing", "rollout_watchdog.refit_bridge.group",
    "rollout_watchdog.refit_bridge.engine_calls", "rollout_watchdog.common.torch_group"])


class Peer:
    """A peer process; ``lines`` collects what it says (``wait_line`` waits for one)."""

    def __init__(self, version: str, fault: str) -> None:
        said, out = _PEERS.Pipe(duplex=False)
        self.proc = _PEERS.Process(target=_peer_main, args=(version, fault, out), daemon=True)
        self.proc.start()
        out.close()   # the peer's end: its death is the end of `said`
        self.lines: list[str] = []
        threading.Thread(target=self._read, args=(said,), daemon=True).start()
        try:
            wait_until(lambda: any(ln.startswith("port ") for ln in self.lines), 60.0,
                       what="the peer's port")
        except TimeoutError:
            self.kill()
            raise
        port = next(ln for ln in self.lines if ln.startswith("port ")).split()[1]
        self.url = f"http://127.0.0.1:{port}"

    def _read(self, said: Connection) -> None:
        with said:
            while True:
                try:
                    self.lines.append(said.recv())
                except EOFError:
                    return

    def wait_line(self, text: str) -> None:
        wait_until(lambda: text in self.lines, 30.0, what=f"the peer printing {text!r}")

    def model_info(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/model_info", timeout=10) as resp:
            info: dict[str, Any] = json.loads(resp.read())
        return info

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)   # (an abrupt death: no cleanup of its own)
        self.proc.join(30.0)


@pytest.fixture
def peers() -> Iterator[Callable[..., list[Peer]]]:
    started: list[Peer] = []

    def start(*faults: str, version: str = "0.5.23") -> list[Peer]:
        made = [Peer(version, fault) for fault in faults]
        started.extend(made)
        return made

    yield start
    for peer in started:
        peer.kill()


def _member(i: int, peer: Peer) -> GroupMember:
    return GroupMember(node_id=f"n{i}", engine="e0", incarnation=i + 1, url=peer.url, tp_size=1)


def _group(ps: list[Peer], **kwargs: Any) -> WeightUpdateGroup:
    return WeightUpdateGroup([_member(i, p) for i, p in enumerate(ps)],
                             master_address="127.0.0.1", http_timeout_s=5.0,
                             init_timeout_s=60.0, **kwargs)


def _weights() -> list[tuple[str, Any]]:
    g = torch.Generator().manual_seed(7)
    return [("a.weight", torch.randn(4, 8, generator=g)),
            ("a.bias", torch.randn(8, generator=g).to(torch.bfloat16)),
            ("b.weight", torch.randn(3, 5, generator=g)),
            ("b.steps", torch.arange(6, dtype=torch.int64))]


def _received(peer: Peer) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = peer.model_info()["weights"]
    return got


def _expected() -> dict[str, list[Any]]:
    return {name: t.tolist() for name, t in _weights()}


# ---- tests --------------------------------------------------------------------------------

def test_build_update_and_version_bucketed_then_flattened(peers: Callable[..., list[Peer]]) -> None:
    """Both transfer modes deliver the exact tensors; the version lands with the last bucket."""
    ps = peers("none", "none")
    group = _group(ps)
    assert group.world_size == 3 and list(group.rank_offsets.values()) == [1, 2]
    group.build()
    assert all(group.session.values())  # 0.5.23 -> begin/end (the peers refuse otherwise)
    group.update_weights(_weights(), weight_version="v1", bucket_bytes=64)  # several buckets
    for p in ps:
        assert p.model_info()["weight_version"] == "v1"
        assert _received(p) == _expected()
    doubled = [(n, t * 2) for n, t in _weights()]
    group.update_weights(doubled, weight_version="v2", flattened=True)
    for p in ps:
        assert p.model_info()["weight_version"] == "v2"
        assert _received(p) == {n: t.tolist() for n, t in doubled}
    group.destroy()
    for p in ps:
        assert p.model_info()["groups"] == []


def test_old_server_gets_no_begin_end(peers: Callable[..., list[Peer]]) -> None:
    """A 0.5.20 server has no begin/end routes (404): the update goes without them."""
    (p,) = peers("none", version="0.5.20")
    group = _group([p])
    group.build()
    assert group.session == {group.members[0]: False}
    group.update_weights(_weights(), weight_version="v1")
    assert p.model_info()["weight_version"] == "v1" and _received(p) == _expected()
    group.destroy()


def test_member_killed_mid_broadcast_is_named_and_retry_works(
        peers: Callable[..., list[Peer]]) -> None:
    """SIGKILL of a member while rank 0 is blocked sending to it: the update raises by itself,
    naming it; a new group without the dead one works."""
    stalled, healthy = peers("stall_update", "none")
    group = _group([stalled, healthy])
    group.build()
    killed_at: list[float] = []

    def kill() -> None:
        stalled.wait_line("in-update")
        killed_at.append(time.monotonic())
        stalled.kill()

    killer = threading.Thread(target=kill)
    killer.start()
    with pytest.raises(GroupMemberFailed) as caught:
        group.update_weights([("w", torch.ones(BIG))], weight_version="v1")
    print(f"SIGKILL -> raise: {time.monotonic() - killed_at[0]:.4f} s")
    killer.join()
    # The dead member first; the live one too only when its own call, its collective broken
    # by the kill, failed before the teardown (it answered: refused, never gone).
    named = [m.url for m in caught.value.members]
    assert named[0] == stalled.url and set(named) <= {stalled.url, healthy.url}
    assert [m.url for m in caught.value.gone] == [stalled.url]
    assert caught.value.lost[0] == ("n0", "e0", 1)
    group.destroy()
    retry = _group([healthy])
    retry.build()
    retry.update_weights(_weights(), weight_version="v2")
    assert healthy.model_info()["weight_version"] == "v2"
    retry.destroy()


def test_abort_frees_a_trainer_blocked_on_an_alive_member(
        peers: Callable[..., list[Peer]]) -> None:
    """A member that accepts the update and never joins (alive, wedged): abort() from another
    thread makes the blocked update raise, naming the wedged member as pending."""
    stalled, healthy = peers("stall_update", "none")
    group = _group([stalled, healthy])
    group.build()
    aborted_at: list[float] = []

    def deadline() -> None:
        stalled.wait_line("in-update")
        wait_until(lambda: group.members[0] in group.calls.pending(), 10.0, what="a pending call")
        aborted_at.append(time.monotonic())
        group.abort("refit deadline")

    watcher = threading.Thread(target=deadline)
    watcher.start()
    with pytest.raises(GroupAborted) as caught:
        group.update_weights([("w", torch.ones(BIG))], weight_version="v1")
    raised_at = time.monotonic()
    watcher.join()
    assert group.members[0] in caught.value.pending
    assert caught.value.reason == "refit deadline"
    print(f"abort -> raise: {raised_at - aborted_at[0]:.4f} s")
    group.destroy()
    assert stalled.proc.is_alive()  # alive: its watchdog, not the bridge, restarts it
    retry = _group([healthy])  # the healthy member's collective was freed by the teardown
    retry.build()
    retry.update_weights(_weights(), weight_version="v2")
    assert healthy.model_info()["weight_version"] == "v2"
    retry.destroy()


def test_abort_frees_a_build_waiting_for_a_member(peers: Callable[..., list[Peer]]) -> None:
    """A member that takes the init call and never joins the rendezvous: abort() frees build()."""
    stalled, healthy = peers("stall_init", "none")
    group = _group([stalled, healthy])
    def deadline() -> None:
        stalled.wait_line("in-init")
        group.abort("refit deadline")

    watcher = threading.Thread(target=deadline)
    watcher.start()
    with pytest.raises(GroupAborted) as caught:
        group.build()
    watcher.join()
    assert group.members[0] in caught.value.pending
    group.destroy()


def in_rendezvous(group: WeightUpdateGroup) -> bool:
    """Whether a thread of `group` is still in the trainer's own side of the rendezvous."""
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        if names.get(ident, "").startswith(f"wug-{group.group_name}") and any(
                f.f_code.co_name == "init_custom_process_group"
                for f, _ in traceback.walk_stack(frame)):
            return True
    return False


def test_unreachable_member_fails_build_at_once(peers: Callable[..., list[Peer]]) -> None:
    """A member whose HTTP port refuses: build() raises GroupMemberFailed naming it, without
    waiting for the rendezvous timeout. destroy() returns once the trainer's own rendezvous has
    ended (torn down), not while it runs on into the caller's next work (printing torch's
    warning of the store's broken connection there)."""
    (healthy,) = peers("none")
    gone = GroupMember("n9", "e3", 4, "http://127.0.0.1:9", 1)
    group = WeightUpdateGroup([GroupMember("n0", "e0", 1, healthy.url, 1), gone],
                              master_address="127.0.0.1", http_timeout_s=5.0,
                              init_timeout_s=60.0, session=True)
    with pytest.raises(GroupMemberFailed) as caught:
        group.build()
    assert caught.value.members == [gone]
    assert "ConnectionRefusedError" in caught.value.detail  # not the rendezvous timeout
    group.destroy(wait_s=10.0)   # (its bound: a loaded host's)
    assert not in_rendezvous(group)


def _healthy(url: str) -> bool:
    return http_request(url + "/health")[0] == 200


@pytest.fixture
def emulators() -> Iterator[Callable[..., list[str]]]:
    """Emulator engines (started together: each loads torch); their URLs."""
    procs: list[Any] = []

    def start(*argsets: tuple[str, ...]) -> list[str]:
        ports = [free_port() for _ in argsets]
        procs.extend(start_emulator(p, *a, wait="none") for p, a in zip(ports, argsets,
                                                                         strict=True))
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_until(functools.partial(_healthy, url), 60, interval=0.1,
                       what=f"{url} healthy")
        return urls

    yield start
    for proc in procs:
        stop_emulator(proc)


def _emulator_info(url: str, path: str) -> dict[str, Any]:
    status, raw = http_request(url + path, "POST" if path == "/generate" else "GET", {
        "text": "The quick brown fox", "sampling_params": {"max_new_tokens": 8,
                                                          "temperature": 0}}
        if path == "/generate" else None)
    assert status == 200, raw
    answer: dict[str, Any] = json.loads(raw)
    return answer


def test_emulators_take_the_weights_and_report_the_version(
        emulators: Callable[..., list[str]]) -> None:
    """Two 0.5.23 emulators and one 0.5.12 (no begin/end): bucketed then flattened, every
    engine reports the version and generates the same text."""
    urls = emulators((), (), ("--sglang-version", "0.5.12"))
    members = [GroupMember(f"n{i}", "e0", 1, url, 1) for i, url in enumerate(urls)]
    group = WeightUpdateGroup(members, master_address="127.0.0.1", http_timeout_s=5.0,
                              init_timeout_s=60.0)
    group.build()
    assert list(group.session.values()) == [True, True, False]
    for version, seed, flattened in (("v1", 1, False), ("v2", 2, True)):
        named = [(n, p.detach().clone()) for n, p in build_model(seed).named_parameters()]
        group.update_weights(named, weight_version=version, bucket_bytes=4096,
                             flattened=flattened)
        assert [_emulator_info(u, "/model_info")["weight_version"] for u in urls] == [version] * 3
        outs = [_emulator_info(u, "/generate")["output_ids"] for u in urls]
        assert outs[0] == outs[1] == outs[2]
    group.destroy()


def test_a_kept_session_spans_updates_until_each_member_ends_it(
        emulators: Callable[..., list[str]]) -> None:
    """A refit's one session (0.5.23 refuses a second begin and an update outside a session):
    two updates in it, then every member's end_session(); the next update begins a new one."""
    urls = emulators((), ("--sglang-version", "0.5.12"))
    members = [GroupMember(f"n{i}", "e0", 1, url, 1) for i, url in enumerate(urls)]
    group = WeightUpdateGroup(members, master_address="127.0.0.1", http_timeout_s=5.0,
                              init_timeout_s=60.0)
    group.build()
    named = [(n, p.detach().clone()) for n, p in build_model(3).named_parameters()]
    half = len(named) // 2
    group.update_weights(named[:half], keep_session=True)
    assert group.in_session
    status, raw = http_request(urls[0] + "/begin_weight_update", "POST", {})
    assert status == 400 and b"already open" in raw   # the session is still open
    group.update_weights(named[half:], weight_version="v1", keep_session=True)
    for m in members:
        group.end_session(m)
    assert not group.in_session
    group.update_weights(named, weight_version="v2")   # a new session: begun, then ended
    assert [_emulator_info(u, "/model_info")["weight_version"] for u in urls] == ["v2"] * 2
    group.destroy()


def test_emulator_wedged_in_the_update_is_named_pending_at_abort(
        emulators: Callable[..., list[str]]) -> None:
    """The emulator's hang fault (alive, /health passing, never joining the broadcast): the
    refit's deadline calls abort() and the blocked update raises naming it."""
    wedged, healthy = emulators((), ())
    group = WeightUpdateGroup([GroupMember("n0", "e0", 1, wedged, 1),
                               GroupMember("n1", "e0", 1, healthy, 1)],
                              master_address="127.0.0.1", http_timeout_s=5.0,
                              init_timeout_s=60.0)
    group.build()
    inject_fault(wedged, "hang_weight_update")
    def deadline() -> None:
        wait_until(lambda: group.members[0] in group.calls.pending(), 10.0, what="a pending call")
        group.abort("refit deadline")

    watcher = threading.Thread(target=deadline)
    watcher.start()
    with pytest.raises(GroupAborted) as caught:
        group.update_weights([("w", torch.ones(BIG))], weight_version="v1")
    watcher.join()
    assert group.members[0] in caught.value.pending
    assert http_request(wedged + "/health")[0] == 200
    group.destroy()


def test_bad_members_are_refused() -> None:
    member = GroupMember("n0", "e0", 1, "http://127.0.0.1:1", 1)
    with pytest.raises(ValueError, match="at least one member"):
        WeightUpdateGroup([], master_address="127.0.0.1", http_timeout_s=1, init_timeout_s=1)
    with pytest.raises(ValueError, match="twice"):
        WeightUpdateGroup([member, member], master_address="127.0.0.1", http_timeout_s=1,
                          init_timeout_s=1)
    with pytest.raises(ValueError, match="http://HOST:PORT"):
        WeightUpdateGroup([GroupMember("n0", "e0", 1, "127.0.0.1:1", 1)],
                          master_address="127.0.0.1", http_timeout_s=1, init_timeout_s=1)


def test_a_call_freed_by_the_teardown_is_not_taken_for_a_gone_member() -> None:
    """One member's update call fails with no answer (its engine died); the group is torn down
    and the others' calls, still under way, are freed by shutting their sockets, which ends
    them as if their engines hung up. Only the first is gone (and lost); the freed ones are
    pending (the refit then asks whether they answer), not gone. Before, a freed call that
    ended before the failure was judged counted as gone: every member was lost."""
    from concurrent.futures import Future

    from rollout_watchdog.refit_bridge.engine_calls import EngineCallError

    members = [GroupMember(f"n{i}", "e0", 1, f"http://127.0.0.1:{i + 1}", 1) for i in range(3)]
    group = WeightUpdateGroup(members, master_address="127.0.0.1", http_timeout_s=1,
                              init_timeout_s=1)
    calls: dict[GroupMember, Future[dict[str, Any]]] = {m: Future() for m in members}
    hung_up = EngineCallError("no answer (RemoteDisconnected: Remote end closed connection "
                              "without response)", answered=False)
    calls[members[1]].set_exception(EngineCallError("no answer (ConnectionResetError)",
                                                    answered=False))

    class Calls:
        """The group's calls, as they go: `release` shuts the sockets of those under way."""

        def abort(self) -> list[GroupMember]:
            return [m for m, fut in calls.items() if not fut.done()]

        def release(self) -> None:
            for fut in calls.values():
                if not fut.done():
                    fut.set_exception(hung_up)

    group.calls = Calls()   # type: ignore[assignment]
    with pytest.raises(GroupMemberFailed) as failed:
        group._fail(calls, [], "update_weights_from_distributed")
    assert failed.value.gone == [members[1]]
    assert failed.value.members == [members[1]]

