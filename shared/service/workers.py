"""The worker contract: how a service's worker threads take jobs off the runtime's queue, beat and answer.

A transport (``zmq_router.py``) puts each accepted request on a bounded queue as a ``Job``. A worker thread takes
it (``Workers.next_job``), runs it and answers it through an ``Answer``: ``event`` replies, then one final ``ok``
or error reply, each handed to the worker's own ``Sink``, which the transport forwards to the client. The sink,
not a socket, is what a worker knows, so a test can answer into a list. Workers beat as they go
(``Workers.beat``): ``health`` turns false when a worker has died or its last beat is older than the service's
``worker_stall_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from shared.protocol import ErrorCode, ProtocolError, Request, Result, encode_error, encode_reply, internal_error


def _never() -> bool:
    return False


@dataclass
class Job:
    header: list[bytes]  # the transport's routing frames, sent back unchanged
    request: Request
    received_at: float
    started_at: float | None = None  # when a worker took it off the queue
    #: Whether its client has cancelled it; long work asks as it goes (the inference scheduler at every step).
    is_cancelled: Callable[[], bool] = _never


class Sink(Protocol):
    """Where a worker thread's replies go: the transport that accepted the job forwards them to its client.
    ``kind`` is ``event``, ``ok`` or ``error``; ``code`` is the error code of an error, else None."""

    def reply(self, job: Job, kind: str, payload: bytes, code: str | None = None) -> None: ...


class Emitter:
    """What a handler uses to stream ``event`` frames before its final result."""

    def __init__(self, send: Callable[[str, dict], None]):
        self._send = send

    def event(self, body: dict[str, Any]) -> None:
        self._send("event", body)


Handler = Callable[[Request, Emitter], dict]


class Answer:
    """The replies to one job, through one worker's sink: events, then one final ok or error."""

    def __init__(self, job: Job, sink: Sink, service: str, log: Any):
        self.job, self._sink, self._service, self._log = job, sink, service, log

    def send(self, kind: str, body: dict | Result) -> None:
        """An ``event`` or the final ``ok`` frame."""
        self._sink.reply(self.job, kind, encode_reply(self.job.request.id, kind, body))

    def fail(self, exc: Exception) -> None:
        """The typed error reply; an unexpected exception is logged as a handler bug, its details kept here."""
        if isinstance(exc, ProtocolError):
            code, message = exc.code, exc.message
        else:
            ref, message = internal_error(self._service, exc)
            self._log.error("handler_failed", type=self.job.request.type, request_id=self.job.request.id, ref=ref,
                            exc_info=(type(exc), exc, exc.__traceback__))
            code = ErrorCode.INTERNAL
        self._sink.reply(self.job, "error", encode_error(self.job.request.id, code, message), code)


class Workers:
    """The bounded queue between the transports and the worker threads, their heartbeats, and the jobs running."""

    def __init__(self, size: int, answer: Callable[[Job, Sink], Answer]):
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=size)
        self._answer = answer
        self._running = 0
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}  # worker thread name -> monotonic time of its last beat
        self.started = time.monotonic()

    @property
    def running(self) -> int:
        """Jobs taken off the queue whose final reply the transport has not yet forwarded."""
        return self._running

    def beat(self) -> None:
        """The calling worker is alive and making progress."""
        self._beats[threading.current_thread().name] = time.monotonic()

    def next_job(self, timeout_s: float | None, sink: Sink) -> Job | None:
        """The next queued request (waiting up to ``timeout_s``; None or 0 = don't wait), or None. Beats first.
        From here until its final reply the job counts as running. A job cancelled while it waited is answered
        ``cancelled`` through ``sink`` and skipped."""
        while True:
            self.beat()
            try:
                job = self.queue.get(timeout=timeout_s) if timeout_s else self.queue.get_nowait()
            except queue.Empty:
                return None
            with self._lock:
                self._running += 1
            job.started_at = self._beats[threading.current_thread().name] = time.monotonic()
            if not job.is_cancelled():
                return job
            self._answer(job, sink).fail(ProtocolError(ErrorCode.CANCELLED, "cancelled by the client before it ran"))
            timeout_s = 0

    def finished(self) -> None:
        """The transport forwarded a running job's final reply."""
        with self._lock:
            self._running -= 1

    def health(self, threads: list[threading.Thread], stall_s: float) -> dict[str, Any]:
        alive = sum(w.is_alive() for w in threads)
        now = time.monotonic()
        oldest = max((now - self._beats.get(w.name, self.started) for w in threads), default=0.0)
        return {"workers": len(threads), "workers_alive": alive, "worker_beat_age_s": round(oldest, 3),
                "workers_ok": alive == len(threads) and oldest <= stall_s}
