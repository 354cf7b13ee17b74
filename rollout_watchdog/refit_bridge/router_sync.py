"""Keeps sglang-router's worker list equal to the coordinator's desired set, off its event loop.

The coordinator calls :meth:`RouterSync.set_desired` (returns at once) whenever membership
changes; one worker thread owns every router and engine HTTP call, one at a time, each bounded
by ``timeout_s``. The coordinator owns membership outright: on start, and on every later
listing, a worker the router lists that is not desired is removed, whoever added it (see
:mod:`rollout_watchdog.refit_bridge.router` for the router flags this needs).

- Removals go first and at once: a dead engine leaves the router with the next call the
  thread makes (after the one in flight, if any: at most ``timeout_s``), before any version
  read or addition that was queued.
- An engine is added only once the weight_version it reports itself (GET /model_info) equals
  the version it must hold; a failed read or addition is retried every ``retry_s`` while the
  engine is still desired. A newer set_desired supersedes what the thread was doing. An
  engine the router accepted is not posted again for ``registration_s`` (the router's
  --worker-startup-timeout-secs): its registration runs in the background, a DELETE does not
  cancel it, and a second one could re-add an engine removed in between.
- Defence in depth: every ``verify_s`` the thread reads the weight_version of every routed
  engine that must hold one. An engine that reports another (its weights were changed behind
  the coordinator's back, or a fresh process answers on a routed URL) is removed from the
  router at once, counted (``version_mismatches`` in :meth:`RouterSync.status`, shown by the
  coordinator's ``ping``) and logged; it is added again only once it reports the right
  version. A read that fails is not a mismatch: a dead engine is the watchdog's to report.
- In sync means a listing made after the last removal shows exactly the desired set.
- The router is listed again every ``resync_s`` when in sync (a restarted router comes back
  empty, a stray worker appears), every ``retry_s`` otherwise, and quickly after an addition
  until it shows up. A router that is down loses nothing: the desired set is kept and applied
  once it answers.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rollout_watchdog.refit_bridge import engine_calls
from rollout_watchdog.refit_bridge.router import (
    WORKER_STARTUP_TIMEOUT_S,
    RouterClient,
    RouterError,
    RouterWorker,
    normalize_url,
    reconcile,
    url_key,
)

__all__ = ["STATUS_URLS", "VERIFY_S", "RouterSync"]

log = logging.getLogger(__name__)
# How soon the router is listed again after an addition (it registers in the background).
CONFIRM_S = 0.1
# How often the routed engines' own weight versions are read (one GET /model_info each).
VERIFY_S = 10.0
# The most URLs `ping` shows in the router's lists (about 200 KB): a bigger fleet's lists are
# paged (`router_urls`), so that `ping` always fits in a message.
STATUS_URLS = 2_000
# What a pending reason shows of the weight_version an engine reported (an engine's answer is
# unbounded; a page of STATUS_URLS reasons must fit in a message).
SHOWN_VERSION_CHARS = 100
_GONE = object()  # marks an engine that is no longer desired

VersionReader = Callable[[str], "str | None"]


class RouterSync:
    """Applies the coordinator's desired router membership from a background thread.

    ``read_weight_version(engine_url)`` defaults to :func:`engine_calls.weight_version` with
    ``timeout_s``; ``verify_s`` is how often routed engines' versions are checked. All public
    methods are thread-safe and never wait on I/O, except :meth:`stop` and
    :meth:`wait_synced`, which wait at most their timeout.
    """

    def __init__(self, url: str, read_weight_version: VersionReader | None = None,
                 timeout_s: float = 5.0, retry_s: float = 1.0, resync_s: float = 5.0,
                 registration_s: float = WORKER_STARTUP_TIMEOUT_S,
                 verify_s: float = VERIFY_S) -> None:
        for name, value in (("retry_s", retry_s), ("resync_s", resync_s),
                            ("registration_s", registration_s), ("verify_s", verify_s)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0, not {value!r}")
        self._client = RouterClient(url, timeout_s)
        self._read = read_weight_version or self._default_reader
        self._retry_s = retry_s
        self._resync_s = resync_s
        self._registration_s = registration_s
        self._verify_s = verify_s
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when the listing changes
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        # Under _lock:
        self._desired: dict[str, str | None] = {}
        self._listed: list[RouterWorker] | None = None  # last listing; None before the first
        self._reachable: bool | None = None
        self._last_error: str | None = None
        self._pending: dict[str, str] = {}  # desired URL -> why it is not added yet
        self._adds = 0
        self._removes = 0
        self._mismatches = 0   # routed engines found reporting another weight_version
        self._last_mismatch: str | None = None
        # One more at each change of the three lists: a reader of pages tells a torn read by it
        self._generation = 0
        # Thread-only:
        self._next_try: dict[str, float] = {}  # URL -> monotonic time of its next add attempt
        self._confirm_until = 0.0  # list again soon until then: a change was just posted
        self._deleted: set[str] = set()  # worker ids removed since the last listing
        # Until then a registration may still land (even of an engine removed since): the
        # router is listed every retry_s, not resync_s.
        self._registering_until = 0.0
        self._step_failed = False
        self._next_verify = 0.0   # monotonic: the next check of the routed engines' versions

    @property
    def url(self) -> str:
        """The router's (normalized) URL."""
        return self._client.url

    def start(self) -> None:
        """Start the thread; its first pass reconciles the router with the desired set."""
        if self._thread is not None:
            raise RuntimeError("RouterSync already started")
        self._thread = threading.Thread(target=self._run, name="router-sync", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop the thread; waits at most ``timeout_s`` (an HTTP call in flight ends within the
        client's timeout). True if it ended."""
        self._stopping.set()
        self._wake.set()
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def set_desired(self, members: Mapping[str, str | None]) -> None:
        """Replace the desired membership: engine URL -> the weight_version it must report
        before it is added (None: no check). Returns at once; ValueError for a bad entry."""
        desired: dict[str, str | None] = {}
        for url, version in members.items():
            if version is not None and not isinstance(version, str):
                raise ValueError(f"weight version for {url!r} must be a string or None, "
                                 f"not {version!r}")
            desired[normalize_url(url)] = version
        with self._lock:
            self._desired = desired
            self._pending = {u: why for u, why in self._pending.items() if u in desired}
            self._generation += 1
            self._changed.notify_all()
        self._wake.set()

    def status(self, max_urls: int | None = None) -> dict[str, Any]:
        """What the coordinator shows: router URL, reachable (None before the first call), the
        URLs listed and desired, why desired engines are not added yet (those three null when
        they hold more than ``max_urls`` URLs together, STATUS_URLS by default: ``urls`` pages
        them; their counts are always there), the lists' ``generation`` (one more at each
        change of them), last error, counts (``version_mismatches``:
        routed engines pulled for reporting another weight_version, the last one described in
        ``last_mismatch``)."""
        with self._lock:
            listed = self._listed or ()
            most = STATUS_URLS if max_urls is None else max_urls
            whole = len(listed) + len(self._desired) + len(self._pending) <= most
            return {
                "router_url": self.url,
                "reachable": self._reachable,
                "listed": sorted(w.url for w in listed) if whole else None,
                "desired": dict(sorted(self._desired.items())) if whole else None,
                "pending": dict(sorted(self._pending.items())) if whole else None,
                "listed_count": len(listed),
                "desired_count": len(self._desired),
                "pending_count": len(self._pending),
                "generation": self._generation,
                "synced": self._synced(),
                "last_error": self._last_error,
                "adds": self._adds,
                "removes": self._removes,
                "version_mismatches": self._mismatches,
                "last_mismatch": self._last_mismatch,
            }

    def urls(self, after: str | None = None, max_urls: int | None = None
             ) -> tuple[list[dict[str, Any]], str | None, int]:
        """Every URL the router lists or should list, in order, after ``after``: at most
        ``max_urls`` of them (STATUS_URLS by default), each {"url", "listed", "desired",
        "weight_version" (the one it must report before it is added, when desired), "pending"
        (why it is not added yet, or None)}; the ``after`` of the next page (None on the
        last); and the lists' generation (as in ``status``): pages of one generation, and the
        status of it, were read from the same lists."""
        with self._lock:
            listed = _urls(self._listed or ())
            desired, pending = dict(self._desired), dict(self._pending)
            generation = self._generation
        every = sorted(listed | desired.keys() | pending.keys())
        start = 0 if after is None else bisect.bisect_right(every, after)
        page = every[start:start + (STATUS_URLS if max_urls is None else max_urls)]
        more = start + len(page) < len(every)
        return [{"url": url, "listed": url in listed, "desired": url in desired,
                 "weight_version": desired.get(url), "pending": pending.get(url)}
                for url in page], page[-1] if more else None, generation

    def wait_synced(self, timeout_s: float) -> bool:
        """Wait until the router lists exactly the desired URLs; False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(self._synced, timeout_s)

    # -- the thread ------------------------------------------------------------------------

    def _default_reader(self, engine_url: str) -> str | None:
        return engine_calls.weight_version(engine_url, self._client.timeout_s)

    def _synced(self) -> bool:
        """Under _lock: the last listing answered and equals the desired set."""
        if not self._reachable or self._listed is None:
            return False
        to_add, to_remove = reconcile(self._desired, self._listed)
        return not to_add and not to_remove

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._step_failed = False
            self._step()
            self._wake.wait(self._next_wait())
            self._wake.clear()  # before the next pass reads the state: no wake-up is lost

    def _step(self) -> None:
        """One pass: removals from the last listing, a fresh listing, removals, additions."""
        with self._lock:
            desired, listed = dict(self._desired), self._listed
        if listed is not None and not self._remove(reconcile(desired, listed)[1]):
            return
        try:
            listed = self._client.workers()
        except RouterError as exc:
            self._fail_router(exc)
            return
        self._deleted.clear()   # whatever this listing still shows is removed again
        to_add, to_remove = reconcile(desired, listed)
        with self._lock:
            pending = {u: why for u, why in self._pending.items() if u in to_add}
            self._generation += (pending != self._pending
                                 or _urls(listed) != _urls(self._listed or []))
            self._listed, self._reachable, self._pending = listed, True, pending
            self._changed.notify_all()
        if not self._remove(to_remove):
            return
        if time.monotonic() >= self._next_verify and not self._verify(desired, listed):
            return
        self._next_try = {u: t for u, t in self._next_try.items() if u in to_add}
        for engine_url in to_add:
            if self._stopping.is_set() or self._superseded(desired):
                return
            if time.monotonic() >= self._next_try.get(engine_url, 0.0):
                self._add(engine_url, desired)
        if not self._step_failed:
            with self._lock:
                self._last_error = None

    def _remove(self, workers: list[RouterWorker]) -> bool:
        """DELETE each worker (once per listing); False (error recorded) at the first failure.
        In sync again only once a later listing shows them gone."""
        for worker in workers:
            if worker.id in self._deleted:
                continue
            try:
                removed = self._client.delete(worker.id)
            except RouterError as exc:
                self._fail_router(exc)
                return False
            self._deleted.add(worker.id)
            self._confirm_until = time.monotonic() + self._retry_s
            with self._lock:
                self._removes += removed
                self._changed.notify_all()
        return True

    def _verify(self, desired: dict[str, str | None], listed: list[RouterWorker]) -> bool:
        """Read the version of every routed engine that must hold one; remove at once each
        that reports another. False (error recorded) if a removal failed."""
        self._next_verify = time.monotonic() + self._verify_s
        for worker in listed:
            engine_url = url_key(worker.url)
            expected = desired.get(engine_url)
            if expected is None or worker.id in self._deleted:
                continue
            if self._stopping.is_set() or self._superseded(desired):
                return True
            try:
                version = self._read(engine_url)
            except Exception:  # noqa: BLE001 - unreadable is not a mismatch (see module doc)
                continue
            if version == expected:
                continue
            why = _mismatch(version, expected)
            log.warning("router %s: engine %s %s: removed from the router", self.url,
                        engine_url, why)
            with self._lock:
                self._mismatches += 1
                self._last_mismatch = f"{engine_url} {why}"
            if not self._remove([worker]):
                return False
            with self._lock:   # still desired: out of sync until a listing shows it back
                self._listed = [w for w in self._listed or () if w.id != worker.id]
                self._generation += 1
            self._next_try[engine_url] = time.monotonic() + self._retry_s
            self._set_pending(engine_url, why)
        return True

    def _add(self, engine_url: str, desired: dict[str, str | None]) -> None:
        """Check the engine's version (if one is expected), then POST it to the router."""
        self._next_try[engine_url] = time.monotonic() + self._retry_s
        expected = desired[engine_url]
        if expected is not None:
            try:
                version = self._read(engine_url)
            except Exception as exc:  # any reader failure (a user callable too) is retried
                self._fail(f"engine {engine_url}: reading weight_version failed: {exc}")
                self._set_pending(engine_url, "weight_version unreadable")
                return
            if version != expected:
                self._set_pending(engine_url, _mismatch(version, expected))
                return
            if self._superseded(desired):
                return
        try:
            self._client.add(engine_url)
        except RouterError as exc:
            self._fail_router(exc)
            self._set_pending(engine_url, "the router refused or did not answer")
            return
        with self._lock:
            self._adds += 1
            self._generation += self._pending.pop(engine_url, None) is not None
        self._next_try[engine_url] = time.monotonic() + self._registration_s
        self._confirm_until = time.monotonic() + self._retry_s
        self._registering_until = time.monotonic() + self._registration_s

    def _next_wait(self) -> float:
        """Soon after a change, retry_s while out of sync, failing or a registration may still
        land, else resync_s; never past the next check of the routed engines' versions."""
        now = time.monotonic()
        if now < self._confirm_until:
            return CONFIRM_S
        with self._lock:
            in_sync = self._synced()
        settled = in_sync and not self._step_failed and now >= self._registering_until
        return min(self._resync_s if settled else self._retry_s,
                   max(0.0, self._next_verify - now))

    def _superseded(self, desired: dict[str, str | None]) -> bool:
        """Whether a set_desired since this pass began dropped or changed an engine of it: then
        removals (or another version) are due first, and the pass starts over. A set_desired
        that only adds engines, or repeats the same set, lets the pass go on."""
        with self._lock:
            return any(self._desired.get(url, _GONE) != version
                       for url, version in desired.items())

    def _set_pending(self, engine_url: str, why: str) -> None:
        with self._lock:
            if engine_url in self._desired and self._pending.get(engine_url) != why:
                self._pending[engine_url] = why
                self._generation += 1

    def _fail_router(self, exc: RouterError) -> None:
        if exc.refused:
            self._next_try.clear()   # refused: a router that is down lost its registrations
        self._fail(str(exc), reachable=exc.status is not None)

    def _fail(self, error: str, reachable: bool | None = None) -> None:
        """Record an error of this pass (and whether the router answered at all)."""
        self._step_failed = True
        with self._lock:
            self._last_error = error
            if reachable is not None:
                self._reachable = reachable
            self._changed.notify_all()


def _urls(workers: Iterable[RouterWorker]) -> set[str]:
    return {w.url for w in workers}


def _mismatch(version: object, expected: str) -> str:
    """Why an engine is kept out, with what it reported cut short: an engine's answer is
    unbounded, and the reason goes into `ping` and `router_urls` pages."""
    shown = repr(version)
    if len(shown) > SHOWN_VERSION_CHARS:
        shown = shown[:SHOWN_VERSION_CHARS] + "..."
    return f"reports weight_version {shown}, not {expected!r}"
