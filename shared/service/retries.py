"""A service's memory of the requests it accepted, so a retried request id never runs twice.

A request is known by its key, (session, id). While it runs, a retry of it waits for the same final reply;
once it has answered ok, its reply is kept (within a byte budget), so a client that lost the reply and retries
gets it back without a second execution. A client may cancel a request it is still waiting for. This memory
lives in the runtime's thread only (the ZeroMQ router's, ``zmq_router.py``) and does not survive a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

_REMEMBERED_BYTES = 16 << 20  # budget for remembered ok replies
_REMEMBER_MAX_REPLY = 64 << 10  # bigger replies are not kept (a retry runs again)


class Seen(Enum):
    NEW = "new"  # run it
    RUNNING = "running"  # a retry of a running request: it gets that request's final reply
    ANSWERED = "answered"  # answered ok before: send the remembered reply


class RetryMemory:
    """Accepted requests until their final reply, and the last ok replies."""

    def __init__(self) -> None:
        self._waiting: dict[tuple, list[list[bytes]]] = {}  # running key -> routing headers of its retries
        self._cancelled: set[tuple] = set()
        self._answered: OrderedDict[tuple, bytes] = OrderedDict()  # key -> final ok reply payload
        self._answered_bytes = 0

    def seen(self, key: tuple, header: list[bytes]) -> Seen:
        """What to do with a request arriving with ``key`` (a retry's ``header`` is kept to answer it later)."""
        if key in self._answered:
            return Seen.ANSWERED
        if key in self._waiting:
            self._waiting[key].append(header)
            return Seen.RUNNING
        return Seen.NEW

    def remembered(self, key: tuple) -> bytes:
        return self._answered[key]

    def accepted(self, key: tuple) -> None:
        """The request ``key`` was queued: it is running until ``answered``."""
        self._waiting[key] = []

    def cancel(self, key: tuple) -> bool:
        """Mark a running request cancelled; whether it is (an unknown or finished one is not)."""
        if key in self._waiting:
            self._cancelled.add(key)
        return key in self._cancelled

    def is_cancelled(self, key: tuple) -> bool:
        """Safe from any thread (a set lookup)."""
        return key in self._cancelled

    def answered(self, key: tuple, ok: bool, payload: bytes) -> list[list[bytes]] | None:
        """The final reply of ``key`` went out: the headers of its waiting retries (None: it was not running)."""
        self._cancelled.discard(key)
        retries = self._waiting.pop(key, None)
        if ok and len(payload) <= _REMEMBER_MAX_REPLY and key not in self._answered:
            self._answered[key] = payload
            self._answered_bytes += len(payload)
            while self._answered_bytes > _REMEMBERED_BYTES:
                self._answered_bytes -= len(self._answered.popitem(last=False)[1])
        return retries

    def unanswered(self) -> bool:
        """Some accepted request has not had its final reply yet."""
        return bool(self._waiting)
