"""Putting the members of a refit whose holder vanished back in service, off the coordinator's
loop.

A trainer that dies or stalls mid-refit leaves its members' generation paused (and maybe an
update session open): their `/health_generate` answers 503, and once deep probes resume every
one of them would be failed and relaunched. So before the coordinator resumes probes after a
lease that did not commit, it does what the trainer's own abort does: `end_weight_update` (a
400 when no session is open: expected) and `continue_generation` on every member, each call
bounded, all of them on one thread of their own. The loop asks `done()` on its turns.
"""

from __future__ import annotations

import logging
import threading

from rollout_watchdog.refit_bridge import engine_calls

log = logging.getLogger(__name__)
PUTBACK_CALL_S = 5.0   # one engine call; a member that does not answer is left to its watchdog
SHOWN_ERRORS = 5       # members named in the warning of a put-back that failed somewhere


def process_ending(refusal: RuntimeError) -> bool:
    """Whether `refusal` (of a new thread) says the interpreter is shutting down. Its main
    thread is still alive when ThreadPoolExecutor starts refusing (threading's exit hooks run
    before the main thread stops), so the refusal's own words say it first."""
    return "interpreter shutdown" in str(refusal) or not threading.main_thread().is_alive()


class PutBack:
    """One put-back: every member's calls run at once on a thread; `done()` once all ended."""

    def __init__(self, what: str, urls: list[str], call_s: float = PUTBACK_CALL_S) -> None:
        self.what, self.urls, self.call_s = what, urls, call_s
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._run, name="refit-putback", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._ended.is_set()

    def _run(self) -> None:
        try:
            try:
                errors = engine_calls.on_each(self.urls, self._one)
            except RuntimeError as exc:   # no new thread once the interpreter is ending
                if not process_ending(exc):
                    raise
                log.warning("%s: the process is ending: %d member(s) not put back in service",
                            self.what, len(self.urls))
                return
            if errors:   # one line, not one per member: a fleet has thousands
                shown = "; ".join(f"{url}: {error}" for url, error in
                                  list(errors.items())[:SHOWN_ERRORS])
                more = len(errors) - SHOWN_ERRORS
                log.warning("%s: %d member(s) not put back in service (their watchdogs "
                            "decide): %s%s", self.what, len(errors), shown,
                            f"; and {more} more" if more > 0 else "")
        finally:
            self._ended.set()

    def _one(self, url: str) -> None:
        try:
            engine_calls.post(url, "/end_weight_update", {}, self.call_s)
        except engine_calls.EngineCallError as exc:
            if not exc.answered:   # gone or hung: continuing would wait as long again
                raise
            log.debug("%s: %s: %s (no update session open)", self.what, url, exc)
        engine_calls.post(url, "/continue_generation", {}, self.call_s)
