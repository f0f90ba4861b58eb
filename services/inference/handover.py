"""From the preparing workers to the scheduler's thread, and the replies back from there.

The preparing workers turn requests into ``GenerationRequest`` values and pass them, with the control and
session messages, through a bounded queue (``Handover``): when it is full the preparing workers wait, the
service queue fills and the service answers ``busy``. The scheduler's thread takes from it between decode
steps and answers through its own sink: a generation's events and final reply go through its ``Outlet``, which
also does a finished generation's bookkeeping (the client's count, the log line, metrics, telemetry).
Nothing here runs the service's own code, so the scheduler never calls back into ``service.py``: what it needs
of the process it runs in is ``Host``, a few of the runtime's methods.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from functools import partial
from typing import Any, Protocol, cast

import msgspec

from shared.metrics import InferenceMetrics, ServiceMetrics
from shared.protocol import ChatResult, ErrorCode, GenerateResult, ProtocolError
from shared.security import session_ref
from shared.service import Answer, Job, Sink
from shared.telemetry import Telemetry
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


class Host(Protocol):
    """What the scheduler's side needs of the process it runs in (``shared.service.Service`` is one)."""

    @property
    def log(self) -> Any: ...

    @property
    def metrics(self) -> ServiceMetrics: ...

    @property
    def telemetry(self) -> Telemetry: ...

    def beat(self) -> None:
        """The calling thread is alive and making progress."""

    def answer(self, job: Job, sink: Sink) -> Answer:
        """The replies to ``job`` through ``sink``."""

    def run_job(self, job: Job, sink: Sink) -> None:
        """Run a registered handler (a session message) and answer it."""

    def stopping_and_answered(self) -> bool:
        """Stopping, and every job taken off the queue has had its final reply."""


class Handover:
    """The bounded queue to the scheduler's thread, and that thread's side of the service: its worker loop,
    its sink, the control and session messages it runs between steps."""

    def __init__(self, host: Host, size: int, scheduler: Scheduler, control: EngineControl, limits: ClientLimits):
        self.host, self.scheduler, self.control, self.limits = host, scheduler, control, limits
        self._size = size
        self._ready: queue.Queue[GenerationRequest | Job] = queue.Queue(maxsize=size)
        self._sink: Sink | None = None  # where the scheduler thread's replies go

    # --- the preparing workers' side -------------------------------------------------------
    def put(self, item: GenerationRequest | Job) -> None:
        """To the scheduler's thread; waits (beating) while its queue is full."""
        while True:
            self.host.beat()
            try:
                return self._ready.put(item, timeout=0.2)
            except queue.Full:
                continue

    def outlet(self, job: Job, client: str) -> "Outlet":
        return Outlet(self, job, client)

    # --- the scheduler thread's side ---------------------------------------------------------
    def schedule(self, sink: Sink) -> None:
        """The scheduler thread's worker loop; stopped and idle, it writes the sessions to disk before it ends
        (this thread owns the engines), while the runtime still answers health as ``stopping``."""
        self._sink = sink
        self.scheduler.run(self._intake, self.host.stopping_and_answered)
        self.host.log.info("sessions_saved", sessions=self.scheduler.persist())

    def answer(self, job: Job) -> Answer:
        """Replies to ``job`` from the scheduler's thread."""
        assert self._sink is not None, "answered before the scheduler's thread started"
        return self.host.answer(job, self._sink)

    def _intake(self, wait_s: float) -> None:
        """Move prepared work into the scheduler (bounded); run the session messages right away, between steps."""
        self.host.beat()
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
                assert self._sink is not None
                self.host.run_job(item, self._sink)

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

    def event(self, body: dict) -> None:
        self._handover.answer(self.job).send("event", body)

    def cancelled(self) -> bool:
        return self.job.is_cancelled()

    def done(self, result: GenerateResult | ChatResult) -> None:
        self._handover.limits.leave(self._client)
        req, host, stats = self.job.request, self._handover.host, result.stats
        stats.settings_id = settings_id(self._handover.control.settings())
        figures = msgspec.structs.asdict(stats)
        host.log.info(req.type, session=session_ref(req.session), request_id=req.id, **figures)
        # metrics_for() made InferenceMetrics for the service that answers generate, the one this outlet serves
        cast(InferenceMetrics, host.metrics).observe_generation(stats)
        self._handover.answer(self.job).send("ok", result)
        host.telemetry.report(dict(figures, type="generation", session=req.session, ok=True))

    def failed(self, exc: Exception) -> None:
        self._handover.limits.leave(self._client)
        self._handover.answer(self.job).fail(exc)

