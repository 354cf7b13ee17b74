"""The trainer's side (rank 0) of an SGLang weight-update group, and the only way out of it
that does not wait for the group timeout (DESIGN.md, "Refit bridge"; SGLANG.md, "Weight refit").

Every engine call that blocks until a collective completes is sent from its own thread
(member_calls.py), the trainer's own part (the rendezvous, the broadcasts) runs beside them,
and the calling thread only ever waits on an event that completions, failures and
:meth:`WeightUpdateGroup.abort` all set. So the caller is never stuck inside torch:
``abort()`` from another thread (the refit's watcher or deadline) makes it raise at once, and
then tears the group down so that torch's own threads and the engines' blocked calls are freed
too (gloo: its sockets; NCCL: its abort).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Iterable
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

from rollout_watchdog.common.torch_group import (
    destroy_process_group,
    init_custom_process_group,
    tcp_init_method,
)
from rollout_watchdog.refit_bridge import engine_calls, sockets
from rollout_watchdog.refit_bridge.buckets import buckets, dtype_name, with_last
from rollout_watchdog.refit_bridge.group_member import (
    GroupAborted,
    GroupMember,
    GroupMemberFailed,
)
from rollout_watchdog.refit_bridge.member_calls import MemberCalls, unanswered
from rollout_watchdog.refit_bridge.rendezvous import free_port

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

log = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 << 20
# After the first failure, how long to keep collecting the other members' answers: a killed
# engine's HTTP call fails within milliseconds, so this names it rather than a bystander.
FAILURE_GRACE_S = 2.0
# When every member that failed so far answered (alive, and saying no: a shape it does not
# have), how long the others get to end their calls on their own before the group is torn down.
# A refusal comes after the member took the data; the others are still taking theirs (a loaded
# machine: seconds), and a teardown then cuts them off mid-collective: gloo's broadcast is a
# tree, so a member below one cut off waits for data that never comes, and was judged wedged and
# restarted (a suite run: UpdateRefused for all three members came out EngineLost).
REFUSAL_WAIT_S = 5.0
UPDATE_CALL = "update_weights_from_distributed"   # the broadcast's calls (_fail)
RENDEZVOUS_RECHECK_S = 0.1   # destroy() tears a failed build's rendezvous down this often


class WeightUpdateGroup:
    """Rank 0 of one weight-update group over ``members``; build once, update, destroy.

    A group is never rebuilt in place: a new membership is a new ``WeightUpdateGroup`` (a fresh
    name and port), as SGLang requires after any failure. ``init_timeout_s`` is the group's
    timeout: it bounds the rendezvous, each collective and the engines' blocking calls;
    ``http_timeout_s`` bounds connecting and every quick call. ``session`` forces the server
    kind (True: 0.5.21+ with begin/end_weight_update); None reads it from ``/server_info``.
    """

    def __init__(self, members: list[GroupMember], *, master_address: str, master_port: int = 0,
                 backend: str = "gloo", group_name: str | None = None,
                 http_timeout_s: float, init_timeout_s: float,
                 session: bool | None = None) -> None:
        if not members:
            raise ValueError("a weight-update group needs at least one member")
        if len({(m.node_id, m.engine) for m in members}) != len(members):
            raise ValueError("a weight-update group lists an engine twice")
        for m in members:
            engine_calls.split_url(m.url)
            if m.tp_size < 1:
                raise ValueError(f"{m.label()}: tp_size must be >= 1, not {m.tp_size}")
        if http_timeout_s <= 0 or init_timeout_s <= 0:
            raise ValueError("http_timeout_s and init_timeout_s must be positive")
        self.members = list(members)
        self.master_address = master_address
        self.master_port = master_port
        self.backend = backend
        self.group_name = group_name or f"rw-{uuid.uuid4().hex[:12]}"
        self.http_timeout_s = http_timeout_s
        self.init_timeout_s = init_timeout_s
        self.world_size = 1 + sum(m.tp_size for m in members)
        self.rank_offsets: dict[GroupMember, int] = {}
        offset = 1
        for m in members:
            self.rank_offsets[m] = offset
            offset += m.tp_size
        self._session_given = session
        self.session: dict[GroupMember, bool] = {}
        self._pg: ProcessGroup | None = None
        self._own_side: Future[ProcessGroup] | None = None   # rank 0's rendezvous
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.calls: MemberCalls[GroupMember] = MemberCalls(
            f"wug-{self.group_name}", len(members) + 1, self._wake,
            http_timeout_s=http_timeout_s, blocking_timeout_s=init_timeout_s)
        self._abort_reason: str | None = None
        self._pending_at_abort: list[GroupMember] = []   # as abort() found them
        self._before: set[int] | None = None  # sockets open before the group was built
        self._own_sockets: set[int] | None = None  # the group's, once built
        self._destroyed = False
        self._open_sessions: list[GroupMember] = []   # begun, not ended (closed by destroy)
        self._in_session: set[GroupMember] = set()   # members of the update session under way
        self._sessions_used = False   # a first session ends any its members had open before

    # ---- public API -------------------------------------------------------------------------

    def build(self) -> None:
        """Join every member and the trainer into the group; raises GroupMemberFailed naming
        the members whose calls failed, GroupAborted after abort()."""
        if self._pg is not None or self._destroyed:
            raise RuntimeError(f"group {self.group_name} was already built")
        self._detect_server_kinds()
        if not self.master_port:
            self.master_port = free_port(self.master_address)
        self._before = set(sockets.socket_inodes().values())
        init_method = tcp_init_method(self.master_address, self.master_port)
        timeout = datetime.timedelta(seconds=self.init_timeout_s)

        def own_side() -> ProcessGroup:
            pg = init_custom_process_group(self.backend, init_method, timeout, self.world_size,
                                           0, self.group_name)
            if self._abort_reason is not None:  # too late: nobody will use it
                self._destroy_pg_bounded(pg)
            return pg

        bodies = {m: {"master_address": self.master_address, "master_port": self.master_port,
                      "rank_offset": self.rank_offsets[m], "world_size": self.world_size,
                      "group_name": self.group_name, "backend": self.backend}
                  for m in self.members}
        calls = self.calls.post_all("/init_weights_update_group", bodies, blocking=True)
        local = self._own_side = self.calls.submit(own_side)
        local.add_done_callback(lambda _f: self._wake.set())
        self._await(calls, [local], "init_weights_update_group")
        self._pg = local.result()
        # The group's own connections: what an abort shuts down later (not whatever else the
        # trainer opens meanwhile: Ray, NCCL, other clients).
        self._own_sockets = (sockets.connected_tcp_inodes() - self._before
                             - self.calls.inodes())

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       weight_version: str | None = None,
                       bucket_bytes: int = DEFAULT_BUCKET_BYTES, flattened: bool = False,
                       keep_session: bool = False) -> None:
        """Send the tensors to every member in buckets (each member's update call sent, then the
        trainer's broadcasts in ``names`` order, then every answer awaited). ``weight_version``
        goes with the last bucket only, so an engine that reports it has every bucket, and so
        does ``flush_cache``. ``flattened``: one broadcast per bucket (SGLang's
        ``flattened_bucket`` load format: every tensor's bytes back to back, any dtypes, as its
        ``FlattenedTensorBucket`` lays them out).
        On 0.5.21+ servers the whole update is bracketed by begin/end_weight_update. With
        ``keep_session`` the session stays open, for more updates, until every member's
        end_session() (a refit ends it in the same round trip as its commit's other calls)."""
        if self._abort_reason is not None:
            raise GroupAborted(self._abort_reason, [])
        if self._pg is None:
            raise RuntimeError(f"group {self.group_name} is not built (call build() first)")
        if bucket_bytes < 1:
            raise ValueError("bucket_bytes must be positive")
        runs = with_last(buckets(named_tensors, bucket_bytes))
        first = next(runs, None)
        if first is None:   # before any session is opened: a caller's mistake costs nothing
            raise ValueError("update_weights got no tensors")
        if not self._in_session:
            self._in_session = set(self.members)
            self._open_sessions = [m for m in self.members if self.session[m]]
            if not self._sessions_used:   # one a holder that lost its lease left open (the
                self._sessions_used = True   # lock is ours now): a 0.5.21+ server refuses to
                self._ask_all("/end_weight_update", {m: {} for m in self._open_sessions},
                              time.monotonic() + self.http_timeout_s)   # begin another
            self._quick_all(self._open_sessions, "/begin_weight_update")
        for bucket, last in itertools.chain([first], runs):
            self._send_bucket(bucket, weight_version if last else None, last, flattened)
        if not keep_session:
            self._quick_all(self._open_sessions, "/end_weight_update")
            self._in_session, self._open_sessions = set(), []

    @property
    def in_session(self) -> bool:
        """An update session is open (begun, not ended on every member)."""
        return bool(self._in_session)

    def end_session(self, m: GroupMember) -> None:
        """End `m`'s update session (its end_weight_update on a 0.5.21+ server); once every
        member's has ended, the next update_weights() begins a new one. Raises EngineCallError;
        a session whose end failed stays open for destroy() to end."""
        with self._lock:
            self._in_session.discard(m)
            begun = m in self._open_sessions
        if begun:
            self.calls.call(m, "POST", "/end_weight_update", {}, False)
            with self._lock:
                self._open_sessions.remove(m)

    @property
    def aborted(self) -> bool:
        """Torn down by abort(): never to be used again."""
        return self._abort_reason is not None

    def abort(self, reason: str = "aborted") -> None:
        """Free the thread that waits in build() or update_weights() (it raises GroupAborted),
        then tear the group down. Safe from any thread, any number of times; never blocks on
        the group. NCCL: the backend's abort. gloo: its sockets shut down (sockets.py), which
        also fails the members' pending collectives, so their calls return."""
        if self._mark_aborted(reason):
            self._teardown_group()
        self.calls.release()

    def destroy(self, wait_s: float = 2.0, skip: Iterable[GroupMember] = ()) -> None:
        """Destroy the trainer's group and ask every member but `skip` (stuck ones, to be
        restarted) to destroy theirs and to end an update session an abort left open, waiting
        at most `wait_s` in all for their answers, then for a failed build's own rendezvous to
        end. Never raises: errors are logged."""
        if self._destroyed:
            return
        self._destroyed = True
        pg, self._pg = self._pg, None
        if pg is not None:
            self._destroy_pg_bounded(pg)
        # An aborted update leaves its session open, and a 0.5.21+ server refuses the next
        # begin_weight_update until it is ended.
        deadline = time.monotonic() + wait_s
        skipped = set(skip)
        self._ask_all("/end_weight_update",
                      {m: {} for m in self._open_sessions if m not in skipped}, deadline)
        self._open_sessions = []
        self._ask_all("/destroy_weights_update_group",
                      {m: {"group_name": self.group_name} for m in self.members
                       if m not in skipped}, deadline)
        self._end_rendezvous(deadline)
        self._own_side = None   # (a built group's future holds the destroyed process group)
        self.calls.shutdown()

    def _end_rendezvous(self, deadline: float) -> None:
        """The trainer's own side of a failed build's rendezvous, torn down again (its store
        may have connected after the build's teardown) at once, then while it runs, until
        `deadline`: so that no thread of the group waits out init_timeout_s into the caller's
        next work."""
        own = self._own_side
        if own is None or own.done():
            return
        self._teardown_group()
        while (left := deadline - time.monotonic()) > 0:
            if wait([own], timeout=min(RENDEZVOUS_RECHECK_S, left)).done:
                return
            self._teardown_group()

    def _ask_all(self, path: str, bodies: dict[GroupMember, dict[str, Any]],
                 deadline: float) -> None:
        """Best effort, until `deadline`: errors are logged, not raised."""
        calls = self.calls.post_all(path, bodies, blocking=False, cleanup=True)
        for m, fut in calls.items():
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001 - destroy never raises
                # Expected here, DEBUG: a refusal (a relaunched incarnation has no group, an
                # aborted update may have ended its session) and a refused connection (a dead
                # incarnation, reported by the refit and its watchdog). A live engine that does
                # not answer is news: INFO.
                expected = isinstance(exc, engine_calls.EngineCallError) and (
                    exc.answered or isinstance(exc.__cause__, ConnectionRefusedError))
                log.log(logging.DEBUG if expected else logging.INFO, "%s at %s: %s",
                        path.strip("/"), m.label(), exc or "no answer")

    # ---- the pieces -------------------------------------------------------------------------

    def _detect_server_kinds(self) -> None:
        if self._session_given is not None:
            self.session = {m: self._session_given for m in self.members}
            return
        infos = {m: self.calls.submit(self.calls.call, m, "GET", "/server_info", None, False)
                 for m in self.members}
        failed: list[GroupMember] = []
        gone: list[GroupMember] = []
        refused: dict[GroupMember, str] = {}
        for m, fut in infos.items():
            try:
                self.session[m] = engine_calls.uses_session(str(fut.result().get("version", "")))
            except (engine_calls.EngineCallError, ValueError) as exc:
                failed.append(m)
                why = f"{exc} (pass session= to say the server kind)"
                if unanswered(fut):
                    gone.append(m)
                else:
                    refused[m] = why
        if failed:
            raise GroupMemberFailed(failed, "; ".join(
                f"{m.label()}: {refused.get(m) or infos[m].exception()}" for m in failed),
                gone=gone, refused=refused)

    def _send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: str | None,
                     last: bool, flattened: bool) -> None:
        import torch
        import torch.distributed as dist

        tensors = [t.detach().contiguous() for _, t in bucket]
        body: dict[str, Any] = {
            "names": [name for name, _ in bucket],
            "dtypes": [dtype_name(t) for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self.group_name, "flush_cache": last,
            "abort_all_requests": False, "weight_version": version,
            "load_format": "flattened_bucket" if flattened else None,
        }
        calls = self.calls.post_all("/update_weights_from_distributed",
                                    {m: body for m in self.members}, blocking=True)
        if flattened:
            tensors = [torch.cat([t.flatten().view(torch.uint8) for t in tensors])]
        works: list[Future[Any]] = []
        for tensor in tensors:
            fut: Future[Any] = Future()
            works.append(fut)
            try:
                work = dist.broadcast(tensor, src=0, group=self._pg, async_op=True)
            except Exception as exc:  # noqa: BLE001 - a broken group: reported like a failure
                fut.set_exception(exc)
                break
            assert work is not None
            work.get_future().add_done_callback(lambda f, fut=fut: self._settle(fut, f))
        self._await(calls, works, UPDATE_CALL)

    def _settle(self, fut: Future[Any], torch_future: Any) -> None:
        """A torch future's outcome, copied into a concurrent one, and the waiter woken."""
        try:
            fut.set_result(torch_future.value())
        except Exception as exc:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(exc)
        self._wake.set()

    def _quick_all(self, members: list[GroupMember], path: str) -> None:
        if members:
            self._await(self.calls.post_all(path, {m: {} for m in members}, blocking=False),
                        [], path.strip("/"))

    def _await(self, calls: dict[GroupMember, Future[dict[str, Any]]], local: list[Future[Any]],
               what: str) -> None:
        """Wait until every call and local part succeeded; raise at the first failure (after a
        short grace to name the right member), on abort(), or at the group timeout."""
        deadline = time.monotonic() + self.init_timeout_s + self.http_timeout_s
        while True:
            self._wake.clear()
            if self._abort_reason is not None:
                raise GroupAborted(self._abort_reason, self._pending_at_abort)
            failed = [m for m, f in calls.items() if f.done() and f.exception() is not None]
            broken = [f for f in local if f.done() and f.exception() is not None]
            if failed or broken:
                self._fail(calls, broken, what)
            if all(f.done() for f in calls.values()) and all(f.done() for f in local):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                pending = self.calls.pending() or list(calls)
                self.abort(f"{what} did not complete within {self.init_timeout_s:g} s")
                raise GroupMemberFailed(pending, f"{what}: no answer within the group timeout")
            self._wake.wait(min(left, 1.0))

    def _fail(self, calls: dict[GroupMember, Future[dict[str, Any]]],
              broken: list[Future[Any]], what: str) -> None:
        """Tear the group down, give the other calls a moment to end (the torn-down group fails
        theirs too), and raise naming the culprits: the members whose calls failed before the
        teardown, else those gone (no answer), else those that said no, else the silent."""
        first = [m for m, f in calls.items() if f.done() and f.exception() is not None]
        reasons = [f"trainer: {f.exception()}" for f in broken]
        # Only a broadcast's calls can be cut off mid-collective: a refused rendezvous cannot
        # complete without its refuser (waiting is pure delay), and quick calls are no collective.
        if what == UPDATE_CALL and not broken \
                and not any(unanswered(calls[m]) for m in first):
            self._wait_calls(calls, REFUSAL_WAIT_S, unless_aborted=True)
        if not self._mark_aborted(f"{what} failed"):
            # Another thread's abort() (the refit's deadline, a loss its guard heard) came
            # first: its release() ends the calls still under way as if their engines hung up,
            # so none of them can be judged here (they would come out gone: lost, EngineLost).
            raise GroupAborted(self._abort_reason or "aborted", self._pending_at_abort)
        self._teardown_group()
        self._wait_calls(calls, FAILURE_GRACE_S)
        # Judged before the calls still under way are freed: a call that `release` shuts ends
        # as if its engine hung up (RemoteDisconnected), and is no sign that the engine is gone.
        judged = {m: f for m, f in calls.items() if f.done()}
        self.calls.release()
        gone: list[GroupMember] = []
        refused: dict[GroupMember, str] = {}
        for m, fut in judged.items():
            exc = fut.exception()
            if exc is None:
                continue
            if unanswered(fut):
                gone.append(m)
            else:
                refused[m] = f"{what}: {exc}"
            reasons.append(f"{m.label()}: {exc}")
        pending = [m for m in calls if m not in judged]
        reasons += [f"{m.label()}: no answer" for m in pending]
        first.sort(key=lambda m: m not in gone)
        culprits = first or gone or list(refused) or pending
        raise GroupMemberFailed(culprits, f"{what}: " + "; ".join(reasons), gone=gone,
                                refused=refused)

    def _wait_calls(self, calls: dict[GroupMember, Future[dict[str, Any]]], most_s: float,
                    unless_aborted: bool = False) -> None:
        """Until every call ended, one is plainly gone (no answer at all), `most_s`, or (with
        `unless_aborted`) an abort (the refit's deadline)."""
        until = time.monotonic() + most_s
        while time.monotonic() < until:
            self._wake.clear()
            ended = [f for f in calls.values() if f.done()]
            if len(ended) == len(calls) or any(unanswered(f) for f in ended) \
                    or (unless_aborted and self._abort_reason is not None):
                return
            self._wake.wait(max(0.0, until - time.monotonic()))

    def _mark_aborted(self, reason: str) -> bool:
        """Record the first reason and wake the waiter; False if already aborted."""
        with self._lock:
            if self._abort_reason is not None:
                return False
            self._abort_reason = reason
            # now, not when the waiter wakes: the teardown that follows ends these calls
            self._pending_at_abort = self.calls.abort()
        self._wake.set()
        log.warning("aborting weight-update group %s: %s", self.group_name, reason)
        return True

    def _teardown_group(self) -> None:
        """Fail every pending collective, here and at the members (module docstring)."""
        if self._pg is not None and self.backend == "nccl":
            try:
                self._pg.abort()
            except Exception as exc:  # noqa: BLE001 - abort is best effort by nature
                log.warning("NCCL abort of %s failed: %s", self.group_name, exc)
        if self._before is None:
            return
        own = self._own_sockets   # (still building: its rendezvous's connections only)
        count = sockets.shutdown_new_sockets(
            self._before, self.calls.inodes(),
            only=own if own is not None else sockets.connected_tcp_inodes(self.master_port))
        log.log(logging.INFO if count else logging.DEBUG, "weight-update group %s: %d sockets "
                "shut down", self.group_name, count)

    def _destroy_pg_bounded(self, pg: ProcessGroup) -> None:
        """destroy_process_group, given http_timeout_s: a group with a hung collective may hang
        its destruction (SGLANG.md), and that must not hang the trainer."""
        done = threading.Event()

        def run() -> None:
            try:
                destroy_process_group(pg)
            except Exception as exc:  # noqa: BLE001 - destroy never raises
                log.info("destroying group %s: %s", self.group_name, exc)
            done.set()

        threading.Thread(target=run, name=f"destroy-{self.group_name}", daemon=True).start()
        if not done.wait(self.http_timeout_s):
            log.warning("group %s not destroyed within %.1f s; left behind", self.group_name,
                        self.http_timeout_s)
