"""Replies to commands, whatever the transport (the local control socket, later the agent).

Every reply carries a status and a reason. A reply may have to wait for a condition (a pause
waits for in-flight probes, `events` for new events): the command returns a `Deferred`, and the
transport parks it in a `PendingReplies`, which answers it when its condition holds or its
deadline passes. Parked replies are bounded per client and in total, so clients that never read
their answers cannot grow the daemon's memory.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
PROTOCOL_VERSION = 1
REPLIES_KEPT = 1024             # replies remembered for repeated request ids
MAX_PARKED_PER_CLIENT = 16
MAX_PARKED_TOTAL = 1024


class CommandError(Exception):
    """A command that cannot be carried out; the message is the reply's reason, `code` its
    typed error code towards the coordinator (protocol.CODES; None: none in particular)."""

    def __init__(self, reason: str, code: str | None = None) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class Deferred:
    """A reply that waits for a condition: `poll()` returns the result once it is ready."""

    poll: Callable[[], dict[str, Any] | None]
    deadline: float                       # monotonic
    on_timeout: Callable[[], dict[str, Any]]


def reply_body(request_id: Any, *, result: Any = None, error: str | None = None
               ) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "status": "error" if error else "ok",
            "reason": error, "result": result}


_R = TypeVar("_R")


class RecentReplies(Generic[_R]):
    """The newest replies by request id, so that a repeated request (a retry, a coordinator
    restart) gets the same answer and is not carried out twice. Bounded in number and, where
    `size` measures a reply, in total size: the oldest give way first."""

    def __init__(self, kept: int = REPLIES_KEPT, max_size: int | None = None,
                 size: Callable[[_R], int] = lambda reply: 0) -> None:
        self.kept, self.max_size, self._measure = kept, max_size, size
        self._replies: OrderedDict[str, _R] = OrderedDict()
        self._total = 0

    def __len__(self) -> int:
        return len(self._replies)

    @property
    def size(self) -> int:
        """The total size of the replies kept, as `size` measures them."""
        return self._total

    def get(self, request_id: str) -> _R | None:
        return self._replies.get(request_id)

    def put(self, request_id: str, reply: _R) -> None:
        old = self._replies.pop(request_id, None)
        self._total += self._measure(reply) - (0 if old is None else self._measure(old))
        self._replies[request_id] = reply
        while len(self._replies) > self.kept or (
                self.max_size is not None and self._total > self.max_size):
            _, dropped = self._replies.popitem(last=False)
            self._total -= self._measure(dropped)


Send = Callable[[dict[str, Any]], None]


@dataclass
class _Parked:
    client: bytes
    request_id: Any
    deferred: Deferred
    send: Send


class PendingReplies:
    """Parked replies of one transport, answered by `answer(now)` on every loop turn."""

    def __init__(self, per_client: int = MAX_PARKED_PER_CLIENT,
                 total: int = MAX_PARKED_TOTAL) -> None:
        self.per_client = per_client
        self.total = total
        self._parked: list[_Parked] = []

    def __len__(self) -> int:
        return len(self._parked)

    def waiting(self, client: bytes, request_id: Any) -> bool:
        """Whether `client`'s request `request_id` is parked (a repeat of it is answered by
        the one reply it gets when done)."""
        return any(p.request_id == request_id and p.client == client for p in self._parked)

    def park(self, client: bytes, request_id: Any, deferred: Deferred, send: Send) -> None:
        """Park a reply; a client over its share, or a full table, is answered with an error
        at once (the oldest of that client's parked replies gives way first)."""
        mine = [p for p in self._parked if p.client == client]
        if len(mine) >= self.per_client:
            oldest = mine[0]
            self._parked.remove(oldest)
            oldest.send(reply_body(oldest.request_id, error=(
                f"too many waiting requests from this client (at most {self.per_client}); "
                "read your replies")))
        if len(self._parked) >= self.total:
            send(reply_body(request_id, error=f"the daemon holds {self.total} waiting "
                            "requests already; try again later"))
            return
        self._parked.append(_Parked(client, request_id, deferred, send))

    def answer(self, now: float) -> None:
        still = []
        for parked in self._parked:
            try:
                result = parked.deferred.poll()
                if result is None and now >= parked.deferred.deadline:
                    result = parked.deferred.on_timeout()
            except CommandError as exc:
                parked.send(reply_body(parked.request_id, error=str(exc)))
                continue
            except Exception as exc:  # a bug in one command must not take the daemon down
                log.exception("deferred reply failed")
                parked.send(reply_body(parked.request_id, error=f"internal error: {exc!r}"))
                continue
            if result is None:
                still.append(parked)
            else:
                parked.send(reply_body(parked.request_id, result=result))
        self._parked = still

    def next_deadline(self) -> float | None:
        return min((p.deferred.deadline for p in self._parked), default=None)
