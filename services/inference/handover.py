"""From the preparing workers to the scheduler's thread, and the replies back from there.

The preparing workers turn requests into ``GenerationRequest`` values and pass them, with the control and
session messages, through a bounded queue (``Handover``): when it is full the preparing workers wait, the
service queue fills and the service answers ``busy``. The scheduler's thread takes from it between decode
steps and answers over its own socket: a generation's events and final reply go through its ``Outlet``, which
also does a finished generation's bookkeeping (the client's count, the log line, metrics, telemetry).
Nothing here runs the service's own code, so the scheduler never calls back into ``service.py``.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from functools import partial
from typing import cast

import msgspec
import zmq

from shared.metrics import InferenceMetrics
from shared.protocol import ChatResult, ErrorCode, GenerateResult, ProtocolError
from shared.security import session_ref
from shared.service import Answer, Job, Service
from services.inference.control import EngineControl
from services.inference.engine import settings_id
from services.inference.scheduler import Control, GenerationRequest, Scheduler


class ClientLimits:
    """At most ``limit`` generations in flight per client (a named tenant or CURVE identity, else a connection)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def enter(self, client: str) -> None:
        with self._lock:
            if self._counts[client] >= self.limit:
                raise ProtocolError(ErrorCode.BUSY, f"this client has {self.limit} generations in flight "
                                                    "(runtime.max_generations_per_client); retry when one ends")
            self._counts[client] += 1

    def leave(self, client: str) -> None:
        with self._lock:
            self._counts[client] -= 1
            if self._counts[client] <= 0:
                del self._counts[client]

    def in_flight(self) -> int:
        return sum(self._counts.values())


class Handover:
    """The bounded queue to the scheduler's thread, and that thread's side of the service: its worker loop,
    its reply socket, the control and session messages it runs between steps."""

    def __init__(self, service: Service, scheduler: Scheduler, control: EngineControl, limits: ClientLimits):
        self._service, self.scheduler, self.control, self.limits = service, scheduler, control, limits
        self._size = service.config.runtime.queue_size
        self._ready: queue.Queue[GenerationRequest | Job] = queue.Queue(maxsize=self._size)
        self._out: zmq.Socket | None = None  # the scheduler thread's reply socket

    # --- the preparing workers' side -------------------------------------------------------
    def put(self, item: GenerationRequest | Job) -> None:
        """To the scheduler's thread; waits (beating) while its queue is full."""
        while True:
            self._service.workers.beat()
            try:
                return self._ready.put(item, timeout=0.2)
            except queue.Full:
                continue

    def outlet(self, job: Job, client: str) -> "Outlet":
        return Outlet(self, job, client)

    # --- the scheduler thread's side ---------------------------------------------------------
    def schedule(self, out: zmq.Socket) -> None:
        """The scheduler thread's worker loop."""
        self._out = out
        self.scheduler.run(self._intake, self._drained)

    def answer(self, job: Job) -> Answer:
        """Replies to ``job`` from the scheduler's thread."""
        return self._service.answer(job, self._out)

    def _drained(self) -> bool:
        """Stopping, and every request taken off the queue has had its final reply (none is being prepared)."""
        return self._service.idle_and_stopping() and self._service.workers.running == 0

    def _intake(self, wait_s: float) -> None:
        """Move prepared work into the scheduler (bounded); run the session messages right away, between steps."""
        self._service.workers.beat()
        while len(self.scheduler.queue) < self._size:
            try:
                item = self._ready.get(timeout=wait_s) if wait_s else self._ready.get_nowait()
            except queue.Empty:
                return
            wait_s = 0
            if isinstance(item, GenerationRequest):
                self.scheduler.submit(item)
            elif item.request.type in self.control.handlers:
                self.scheduler.submit(Control(partial(self._run_control, item),
                                              partial(self.control.needs_drain, item.request)))
            else:
                self._service.run_job(item, self._out)

    def _run_control(self, job: Job) -> None:
        answer = self.answer(job)
        try:
            answer.send("ok", self.control.run(job.request))
        except Exception as exc:
            answer.fail(exc)


class Outlet:
    """Where one generation's replies go from the scheduler's thread, with a finished generation's bookkeeping."""

    def __init__(self, handover: Handover, job: Job, client: str):
        self._handover, self.job, self._client = handover, job, client
        self._service = handover._service

    def event(self, body: dict) -> None:
        self._handover.answer(self.job).send("event", body)

    def cancelled(self) -> bool:
        return self._service.retries.is_cancelled(self.job.request.key)

    def done(self, result: GenerateResult | ChatResult) -> None:
        self._handover.limits.leave(self._client)
        req, service, stats = self.job.request, self._service, result.stats
        stats.settings_id = settings_id(self._handover.control.settings())
        figures = msgspec.structs.asdict(stats)
        service.log.info(req.type, session=session_ref(req.session), request_id=req.id, **figures)
        # metrics_for() made InferenceMetrics for the service that answers generate, the one this outlet serves
        cast(InferenceMetrics, service.metrics).observe_generation(stats)
        self._handover.answer(self.job).send("ok", result)
        service.telemetry.report(dict(figures, type="generation", session=req.session, ok=True))

    def failed(self, exc: Exception) -> None:
        self._handover.limits.leave(self._client)
        self._handover.answer(self.job).fail(exc)

