"""RouterClient and RouterSync against the real sglang-router binary and real emulator engines.

What a coordinator relies on: the router lists exactly the engines it wants; a dead engine
leaves it at once; an engine is added only once it reports the expected weight_version; a
router that dies or hangs costs the caller nothing and is caught up with once it is back.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("sglang_router", reason="needs sglang-router 0.3.x (the test extra)")

from router_harness import Router  # noqa: E402

from rollout_watchdog.common.errors import RolloutWatchdogError  # noqa: E402
from rollout_watchdog.emulator.testing import (  # noqa: E402
    free_port,
    http_request,
    start_emulator,
    stop_emulator,
    wait_until,
)
from rollout_watchdog.refit_bridge.router import (  # noqa: E402
    RouterClient,
    RouterError,
    RouterWorker,
    normalize_url,
    reconcile,
    url_key,
)
from rollout_watchdog.refit_bridge.router_sync import RouterSync  # noqa: E402

DEADLINE_S = 15.0  # for conditions that take well under a second when all is well
PROMPT = {"text": "the same prompt", "sampling_params": {"max_new_tokens": 4}}


class Engines:
    """Emulator engines started in parallel; all SIGKILLed at teardown."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, count: int, version: str = "v1") -> list[str]:
        """``count`` engines reporting weight_version ``version``; their URLs once all are up."""
        urls = []
        for _ in range(count):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            self.procs[urls[-1]] = start_emulator(port, "--weight-version", version, wait="none")
        for url in urls:
            wait_until(functools.partial(ready, url), 60.0, what=f"emulator {url} ready")
        return urls

    def start_booting(self, boot_s: float) -> str:
        """One engine still booting for ``boot_s`` (its /health fails until then); at once."""
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.procs[url] = start_emulator(port, "--weight-version", "v1", "--startup-delay",
                                         str(boot_s), wait="none")
        return url

    def kill(self, url: str) -> None:
        stop_emulator(self.procs[url])


def ready(url: str) -> bool:
    return http_request(f"{url}/health_generate")[0] == 200


@pytest.fixture
def engines() -> Iterator[Engines]:
    made = Engines()
    yield made
    for proc in made.procs.values():
        stop_emulator(proc)



@pytest.fixture
def make_sync() -> Iterator[Callable[..., RouterSync]]:
    made: list[RouterSync] = []

    def make(url: str, timeout_s: float = 5.0, resync_s: float = 0.5,
             verify_s: float = 10.0) -> RouterSync:
        sync = RouterSync(url, timeout_s=timeout_s, retry_s=0.2, resync_s=resync_s,
                          verify_s=verify_s)
        made.append(sync)
        return sync

    yield make
    for sync in made:
        assert sync.stop(15.0), "RouterSync thread did not stop"


def listed_urls(client: RouterClient) -> set[str]:
    return {w.url for w in client.workers()}


def wait_listed(client: RouterClient, urls: set[str]) -> None:
    wait_until(lambda: listed_urls(client) == urls, DEADLINE_S, what=f"router listing {urls}")


def test_a_long_url_list_is_left_to_pages(make_sync: Callable[..., RouterSync]) -> None:
    """`ping` shows the router's URL lists only while they are short (STATUS_URLS together):
    past that they are null, their counts say how many, and `urls` pages every URL in
    order with what is known of it."""
    sync = make_sync("http://127.0.0.1:9")   # never started: the desired set alone
    want = {f"http://10.0.0.{i}:30000": f"v{i}" for i in range(5)}
    sync.set_desired(want)
    short = sync.status(max_urls=5)
    assert short["desired"] == want and short["listed"] == [] and short["desired_count"] == 5
    long = sync.status(max_urls=4)
    assert long["listed"] is None and long["desired"] is None and long["pending"] is None
    assert (long["listed_count"], long["desired_count"], long["pending_count"]) == (0, 5, 0)
    pages, after = [], None
    while True:
        page, after, generation = sync.urls(after, max_urls=2)
        assert generation == long["generation"]   # the same lists as the status
        pages.append(page)
        if after is None:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [(e["url"], e["desired"], e["weight_version"], e["listed"], e["pending"])
            for p in pages for e in p] == [(u, True, v, False, None)
                                            for u, v in sorted(want.items())]
    # a change between two pages shows in the generation: the reader knows its read is torn
    sync.set_desired({**want, "http://10.0.0.9:30000": "v9"})
    assert sync.urls(None, max_urls=2)[2] > generation
    sync.set_desired(dict(want))
    assert sync.status()["generation"] > generation + 1


def test_reconcile_compares_normalized_urls() -> None:
    listed = [RouterWorker("1", "http://a:1/", True), RouterWorker("2", "http://A:1", True),
              RouterWorker("3", "http://stray:9", False)]
    to_add, to_remove = reconcile({"http://a:1", "http://b:2/"}, listed)
    assert to_add == ["http://b:2"]
    assert [w.id for w in to_remove] == ["2", "3"]  # the second spelling of a:1, the stray
    assert reconcile(set(), []) == ([], [])
    with pytest.raises(ValueError, match="not an http"):
        reconcile({"a:1"}, [])
    assert normalize_url("HTTP://[FE80::1]:80/") == "http://[fe80::1]"   # brackets kept, once
    assert normalize_url("http://[::1]:30000") == "http://[::1]:30000"


def test_client_adds_lists_and_removes(router: Router, engines: Engines) -> None:
    a, b = engines.start(2)
    client = RouterClient(router.url + "/")
    assert client.workers() == []
    client.add(a)
    client.add(b + "/")  # stored normalized, so it compares equal later
    wait_listed(client, {a, b})
    assert all(w.healthy for w in client.workers())
    worker_a, = [w for w in client.workers() if url_key(w.url) == normalize_url(a)]
    assert client.delete(worker_a.id) is True
    wait_listed(client, {b})
    assert client.delete(worker_a.id) is False  # absent is fine
    assert client.delete(str(uuid.uuid4())) is False  # an id the router does not know


def test_client_errors_name_the_router() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    client = RouterClient(url, timeout_s=2.0)
    with pytest.raises(RouterError) as caught:
        client.workers()
    assert isinstance(caught.value, RolloutWatchdogError)
    assert url in str(caught.value) and "listing workers" in str(caught.value)
    assert caught.value.status is None
    with pytest.raises(RouterError, match=f"router {url}: adding http://127.0.0.1:1 failed"):
        client.add("http://127.0.0.1:1")
    with pytest.raises(ValueError, match="not an http"):
        RouterClient("127.0.0.1:30000")


def test_start_reconciles_router_with_desired(router: Router, engines: Engines,
                                              make_sync: Callable[..., RouterSync]) -> None:
    a, b, stray = engines.start(3)
    client = RouterClient(router.url)
    client.add(stray)
    client.add(a)
    wait_listed(client, {stray, a})
    sync = make_sync(router.url)
    sync.set_desired({a: "v1", b: "v1"})
    sync.start()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert listed_urls(client) == {a, b}
    status = sync.status()
    # b posted once, or once more per add job of the router's own that gave up on it (its
    # health checks, on a loaded host: see the pending-registration test below)
    assert status["adds"] == 1 + router.failed_add_jobs(b), (status, router.log_tail())
    # the stray removed once, or again if a listing taken before the router's removal job ran
    # still showed it (as for a killed engine, below)
    assert 1 <= status["removes"] <= 3, status
    assert status["reachable"] is True and status["last_error"] is None
    assert status["listed"] == sorted([a, b])


def test_add_waits_for_expected_weight_version(router: Router, engines: Engines,
                                               make_sync: Callable[..., RouterSync]) -> None:
    (engine,) = engines.start(1, version="v1")
    client = RouterClient(router.url)
    sync = make_sync(router.url)
    sync.start()
    sync.set_desired({engine: "v2"})
    wait_until(lambda: "'v1'" in sync.status()["pending"].get(engine, ""), DEADLINE_S,
               what="the engine pending on its weight version")
    assert client.workers() == [] and sync.status()["adds"] == 0
    assert not sync.wait_synced(0.5)
    status, _ = http_request(f"{engine}/update_weight_version", "POST", {"new_version": "v2"})
    assert status == 200
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert listed_urls(client) == {engine} and sync.status()["pending"] == {}


def test_a_routed_engine_whose_version_drifts_is_pulled_counted_and_readded(
        router: Router, engines: Engines, make_sync: Callable[..., RouterSync]) -> None:
    """Defence in depth: a routed engine that reports another weight_version itself (weights
    loaded behind the coordinator's back) leaves the router at the next check, without any
    set_desired, and comes back once it reports the expected version."""
    steady, drifting = engines.start(2, version="v1")
    client = RouterClient(router.url)
    sync = make_sync(router.url, verify_s=0.3)
    sync.set_desired({steady: "v1", drifting: "v1"})
    sync.start()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert sync.status()["version_mismatches"] == 0
    status, _ = http_request(f"{drifting}/update_weight_version", "POST", {"new_version": "v0"})
    assert status == 200
    # The sync deletes the worker first and marks it pending just after: wait for both.
    wait_until(lambda: listed_urls(client) == {steady}
               and "'v0'" in sync.status()["pending"].get(drifting, ""), DEADLINE_S,
               what="the drifted engine out of the router and pending, naming its version")
    state = sync.status()
    # counted, and again at a check that still found it listed (the router's removal job is
    # asynchronous: under load it can run after the next check, 0.3 s later)
    assert state["version_mismatches"] >= 1 and "'v0'" in state["last_mismatch"], state
    status, _ = http_request(f"{drifting}/update_weight_version", "POST", {"new_version": "v1"})
    assert status == 200
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert listed_urls(client) == {steady, drifting}


def test_killed_engine_leaves_router_and_survivors_serve(
        router: Router, engines: Engines, make_sync: Callable[..., RouterSync]) -> None:
    a, b, doomed = engines.start(3)
    client = RouterClient(router.url)
    sync = make_sync(router.url, resync_s=30.0)  # the removal must not wait for a resync
    sync.set_desired({a: "v1", b: "v1", doomed: "v1"})
    sync.start()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    engines.kill(doomed)
    sync.set_desired({a: "v1", b: "v1"})
    assert sync.wait_synced(DEADLINE_S), sync.status()
    # Removed at once (not at a resync), once; again only if a listing taken before the
    # router's removal job ran still showed it (its job queue is asynchronous: under load the
    # second DELETE's job then fails "not found"), never for ever
    assert listed_urls(client) == {a, b} and 1 <= sync.status()["removes"] <= 3
    for _ in range(6):
        status, body = http_request(f"{router.url}/generate", "POST", PROMPT, timeout=30.0)
        assert status == 200, body[:300]
        assert b'"weight_version": "v1"' in body


def test_a_pending_registration_is_not_doubled_and_a_removal_holds(
        router: Router, engines: Engines, make_sync: Callable[..., RouterSync]) -> None:
    """The router registers a worker in the background, once its /health passes, and a DELETE
    does not cancel that. An engine still booting is posted once (not every retry_s while the
    router does not list it yet), and after its removal the sync is in sync only once a listing
    shows it gone: nothing re-adds it later.

    On a loaded host the router's own add job can give up on the booting engine (its health
    checks fail until the boot ends: "Failed job: type=AddWorker"); posting again is then right,
    once per failed job."""
    booting = engines.start_booting(1.5)
    sync = make_sync(router.url)   # retry_s 0.2: seven retries within the boot
    sync.set_desired({booting: None})
    sync.start()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert sync.status()["adds"] == 1 + router.failed_add_jobs(booting), (
        sync.status(), router.log_tail())
    sync.set_desired({})
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert listed_urls(RouterClient(router.url)) == set()


def test_router_killed_and_restarted_reconverges(router: Router, engines: Engines,
                                                 make_sync: Callable[..., RouterSync]) -> None:
    a, b = engines.start(2)
    sync = make_sync(router.url)
    sync.set_desired({a: "v1", b: "v1"})
    sync.start()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    router.kill()
    wait_until(lambda: sync.status()["reachable"] is False, DEADLINE_S, what="router seen down")
    status = sync.status()
    assert router.url in status["last_error"] and not status["synced"]
    sync.set_desired({a: "v1"})  # changed while the router is down: applied once it is back
    router.restart()
    assert sync.wait_synced(DEADLINE_S), sync.status()
    assert listed_urls(RouterClient(router.url)) == {a}
    assert sync.status()["last_error"] is None


def test_router_down_at_start_loses_nothing(engines: Engines,
                                            make_sync: Callable[..., RouterSync]) -> None:
    (engine,) = engines.start(1)
    router = Router.unstarted()
    sync = make_sync(router.url)
    sync.start()
    sync.set_desired({engine: "v1"})
    wait_until(lambda: router.url in (sync.status()["last_error"] or ""), DEADLINE_S,
               what="last_error naming the router")
    assert sync.status()["reachable"] is False and sync.status()["desired"] == {engine: "v1"}
    try:
        router.restart()
        assert sync.wait_synced(DEADLINE_S), sync.status()
    finally:
        router.stop()


def test_hung_router_never_blocks_the_caller(make_sync: Callable[..., RouterSync]) -> None:
    """A router that accepts connections and never answers: the sync thread's call hangs for its
    timeout, and set_desired / status still return while it does."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)  # never accepted: the kernel completes the handshake, nobody answers
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        sync = make_sync(url, timeout_s=3.0)
        sync.start()

        def coordinator_step() -> None:
            sync.set_desired({"http://127.0.0.1:1": None})
            sync.status()

        caller = threading.Thread(target=coordinator_step)
        caller.start()
        caller.join(1.0)
        assert not caller.is_alive(), "set_desired/status blocked on the sync thread's I/O"
        wait_until(lambda: "timed out" in (sync.status()["last_error"] or ""), 10.0,
                   what="the listing timing out")
        assert url in sync.status()["last_error"]
