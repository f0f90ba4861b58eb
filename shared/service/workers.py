"""The worker contract: how a service's worker threads take jobs off the I/O loop's queue, beat and answer.

The I/O loop (``loop.py``) puts each accepted request on a bounded queue as a ``Job``. A worker thread takes it
(``Workers.next_job``), runs it and answers it through an ``Answer``: ``event`` frames, then one final ``ok`` or
error frame, sent over the worker's own inproc socket (ZeroMQ sockets are not thread-safe), each prefixed with
the bookkeeping the loop needs. Workers beat as they go (``Workers.beat``): ``health`` turns false when a worker
has died or its last beat is older than the service's ``worker_stall_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgpack
import zmq

from shared.protocol import ErrorCode, ProtocolError, Request, Result, encode_error, encode_reply, internal_error


@dataclass
class Job:
    header: list[bytes]  # ROUTER routing frames, sent back unchanged
    request: Request
    received_at: float
    started_at: float | None = None  # when a worker took it off the queue


class Emitter:
    """What a handler uses to stream ``event`` frames before its final result."""

    def __init__(self, send: Callable[[str, dict], None]):
        self._send = send

    def event(self, body: dict[str, Any]) -> None:
        self._send("event", body)


Handler = Callable[[Request, Emitter], dict]


class Answer:
    """The replies to one job, sent over one worker's socket: events, then one final ok or error."""

    def __init__(self, job: Job, out: zmq.Socket, service: str, log: Any):
        self.job, self._out, self._service, self._log = job, out, service, log

    def send(self, kind: str, body: dict | Result) -> None:
        """An ``event`` or the final ``ok`` frame."""
        self._frame(kind, encode_reply(self.job.request.id, kind, body))

    def fail(self, exc: Exception) -> None:
        """The typed error reply; an unexpected exception is logged as a handler bug, its details kept here."""
        if isinstance(exc, ProtocolError):
            code, message = exc.code, exc.message
        else:
            ref, message = internal_error(self._service, exc)
            self._log.error("handler_failed", type=self.job.request.type, request_id=self.job.request.id, ref=ref,
                            exc_info=(type(exc), exc, exc.__traceback__))
            code = ErrorCode.INTERNAL
        self._frame("error", encode_error(self.job.request.id, code, message), code)

    def _frame(self, kind: str, payload: bytes, code: str | None = None) -> None:
        job, req = self.job, self.job.request
        bookkeeping = msgpack.packb([req.session, req.id, kind, req.type, job.received_at, job.started_at, code])
        self._out.send_multipart([bookkeeping] + job.header + [payload])


class Workers:
    """The bounded queue between the I/O loop and the worker threads, their heartbeats, and the jobs running."""

    def __init__(self, size: int, is_cancelled: Callable[[tuple], bool],
                 answer: Callable[[Job, zmq.Socket], Answer]):
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=size)
        self._is_cancelled, self._answer = is_cancelled, answer
        self._running = 0
        self._lock = threading.Lock()
        self._beats: dict[str, float] = {}  # worker thread name -> monotonic time of its last beat
        self.started = time.monotonic()

    @property
    def running(self) -> int:
        """Jobs taken off the queue whose final reply the loop has not yet forwarded."""
        return self._running

    def beat(self) -> None:
        """The calling worker is alive and making progress."""
        self._beats[threading.current_thread().name] = time.monotonic()

    def next_job(self, timeout_s: float | None, out: zmq.Socket) -> Job | None:
        """The next queued request (waiting up to ``timeout_s``; None or 0 = don't wait), or None. Beats first.
        From here until its final reply the job counts as running. A job cancelled while it waited is answered
        ``cancelled`` on ``out`` and skipped."""
        while True:
            self.beat()
            try:
                job = self.queue.get(timeout=timeout_s) if timeout_s else self.queue.get_nowait()
            except queue.Empty:
                return None
            with self._lock:
                self._running += 1
            job.started_at = self._beats[threading.current_thread().name] = time.monotonic()
            if not self._is_cancelled(job.request.key):
                return job
            self._answer(job, out).fail(ProtocolError(ErrorCode.CANCELLED, "cancelled by the client before it ran"))
            timeout_s = 0

    def finished(self) -> None:
        """The loop forwarded a running job's final reply."""
        with self._lock:
            self._running -= 1

    def health(self, threads: list[threading.Thread], stall_s: float) -> dict[str, Any]:
        alive = sum(w.is_alive() for w in threads)
        now = time.monotonic()
        oldest = max((now - self._beats.get(w.name, self.started) for w in threads), default=0.0)
        return {"workers": len(threads), "workers_alive": alive, "worker_beat_age_s": round(oldest, 3),
                "workers_ok": alive == len(threads) and oldest <= stall_s}
