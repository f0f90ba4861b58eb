"""A ZeroMQ service: ``Service``, the runtime (``runtime.py``) with the ROUTER front (``zmq_router.py``) and
worker threads that run registered handlers.

Each request the router accepts waits on the runtime's bounded queue; a worker thread takes it (``work_loop``),
runs its handler (``run_job``) and answers through its sink. A service that schedules work itself (the inference
scheduler) overrides ``worker_loops`` or ``serve``.
"""

from __future__ import annotations

from typing import Callable

from shared.config import Config
from shared.protocol import MESSAGES
from shared.service.runtime import Runtime
from shared.service.workers import Emitter, Handler, Job, Sink
from shared.service.zmq_router import ZmqRouter


class Service(Runtime):
    """Subclass, register handlers with ``handle``, and call ``run``."""

    worker_threads = 1
    #: Message types a subclass's own ``work_loop`` schedules instead of a registered handler.
    scheduled: frozenset[str] = frozenset()

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config)
        self._handlers: dict[str, Handler] = {}
        self.router = ZmqRouter(self, endpoint or config.runtime.endpoint(self.name),
                                handled=lambda: self._handlers.keys() | self.scheduled)
        self.transports.append(self.router)

    def handle(self, msg_type: str, handler: Handler) -> None:
        if msg_type not in MESSAGES:
            raise ValueError(f"{msg_type!r} is not declared in shared.protocol.MESSAGES")
        self._handlers[msg_type] = handler

    # --- the worker threads -------------------------------------------------------------------
    def watched_loops(self) -> list[Callable[[], None]]:
        """The worker loops first, each answering through a sink of its own."""
        return [self.router.with_sink(loop) for loop in self.worker_loops()] + super().watched_loops()

    def worker_loops(self) -> list[Callable[[Sink], None]]:
        """What each worker thread runs: ``worker_threads`` copies of ``work_loop``."""
        return [self.work_loop] * self.worker_threads

    def work_loop(self, sink: Sink) -> None:
        """One request at a time (``serve``); a service that batches overrides this."""
        while True:
            job = self.workers.next_job(0.2, sink)
            if job is None:
                if self.idle_and_stopping():
                    return
                continue
            self.serve(job, sink)

    def serve(self, job: Job, sink: Sink) -> None:
        """What ``work_loop`` does with each job: run its handler."""
        self.run_job(job, sink)

    def run_job(self, job: Job, sink: Sink) -> None:
        answer = self.answer(job, sink)
        try:
            answer.send("ok", self._handlers[job.request.type](job.request, Emitter(answer.send)))
        except Exception as exc:  # a handler bug must cost one request, not the service
            answer.fail(exc)
