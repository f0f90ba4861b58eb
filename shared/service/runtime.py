"""What every Magnitude process runs, whatever its requests arrive by: ``Runtime``.

The runtime owns the process's life: it opens its transports (the ZeroMQ router, ``zmq_router.py``; the
gateway's HTTP server), starts the threads it watches (worker threads, and a transport's own server thread),
polls its transports on its own thread, and on SIGTERM/SIGINT stops intake and drains. It also keeps what
every process reports: ``health``, the metrics (``shared.metrics``) and the telemetry for the optimizer
(``shared.telemetry``), and it sweeps dead processes' shared memory (``shared.shm``). It knows nothing of
ZeroMQ or HTTP: a transport is anything with the ``Transport`` methods.

``health`` answers ``ok: false`` when a watched thread has died or its last beat is older than
``worker_stall_s``, because a transport answering health proves nothing about the workers; the watchdog then
restarts the process as hung.

Draining: once stopping, the runtime waits until no transport holds accepted work without its final reply
(``Transport.unanswered``), judged by the transports, not by the workers, so a request a worker has taken but
not yet counted as running (a first prefill) is still answered; ``runtime.drain_timeout_s`` at most.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

import psutil

from shared import shm
from shared.config import Config
from shared.logs import configure_logging
from shared.metrics import metrics_for
from shared.process import INSTANCE
from shared.protocol import PROTOCOL_VERSION
from shared.security import private_dir
from shared.telemetry import NullTelemetry, Telemetry
from shared.service.workers import Answer, Job, Sink, Workers

POLL_S = 0.1  # how long one round of the runtime's loop waits on its transports
#: How long the watched threads may take to end after the drain: within the exit margin of
#: ``runtime.stop_timeout_s`` (15 s), which is what a stopper waits after SIGTERM beyond the drain.
THREADS_END_S = 10.0
_REAP_EVERY_S = 5.0


class Transport:
    """A way requests reach the runtime. The runtime calls these in this order; each does nothing by default."""

    def open(self) -> dict[str, Any]:
        """Bind, before any thread starts (a taken address stops the start); what to say in the start log."""
        return {}

    def loops(self) -> list[Callable[[], None]]:
        """What to run on threads the runtime watches like its workers (a server with its own event loop)."""
        return []

    def poll(self, timeout_s: float) -> None:
        """Serve what has arrived, waiting up to ``timeout_s``, on the runtime's own thread. A transport served
        on a thread of its own returns at once: another's wait (the ZeroMQ router's) paces the loop."""

    def stop(self) -> None:
        """Stop intake (called from the signal handler): what arrives from now on is refused."""

    def unanswered(self) -> bool:
        """Accepted work still waits for its final reply: a stopping runtime waits for it."""
        return False

    def close(self) -> None:
        """After the drain: send what is left and release the address."""


class Runtime:
    """Subclass, give it its transports (``self.transports``), and call ``run``."""

    name = "service"

    def __init__(self, config: Config):
        self.config = config
        self.log = configure_logging(self.name, config.runtime.log_level)
        self.shm_pool = shm.ShmPool()
        self.transports: list[Transport] = []
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self.workers = Workers(config.runtime.queue_size, self.answer)
        self.metrics = metrics_for(self.name, os.getpid(), queue_depth=self.workers.queue.qsize,
                                   running=lambda: self.running(),
                                   uptime_s=lambda: time.monotonic() - self.workers.started)
        self.telemetry = self.make_telemetry()

    # --- to be overridden by subclasses ------------------------------------------------------
    def health_details(self) -> dict[str, Any]:
        """Service-specific health fields (e.g. the model name)."""
        return {}

    def close(self) -> None:
        """Release resources after the runtime has stopped."""

    def serving(self) -> None:
        """Called once the transports are open and the threads run: start here what must not run for a failed
        start."""

    def worker_stall_s(self) -> float:
        """A watched thread silent for longer than this is stuck (a service whose jobs may run longer raises it)."""
        return self.config.runtime.worker_stall_s

    def watched_loops(self) -> list[Callable[[], None]]:
        """What the watched threads run: the transports' loops (a service with workers adds its worker loops)."""
        return [loop for t in self.transports for loop in t.loops()]

    def make_telemetry(self) -> Telemetry:
        """Where this service's samples go: the optimizer (which overrides this: it must not report to itself)."""
        if not self.config.engine.self_optimize:
            return NullTelemetry()
        return Telemetry.for_service(self.name, self.config, queue_depth=self.workers.queue.qsize)

    def running(self) -> int:
        """Requests being worked on: the workers' jobs (a service whose work bypasses the queue overrides this)."""
        return self.workers.running

    # --- what worker threads and transports use --------------------------------------------
    def answer(self, job: Job, sink: Sink) -> Answer:
        """The replies to ``job``, through the calling worker's ``sink``."""
        return Answer(job, sink, self.name, self.log)

    def beat(self) -> None:
        """The calling watched thread is alive and making progress."""
        self.workers.beat()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def idle_and_stopping(self) -> bool:
        """Stopping with nothing queued: a worker may exit."""
        return self.stopping and self.workers.queue.empty()

    def stopping_and_answered(self) -> bool:
        """Stopping, and every job taken off the queue has had its final reply (a thread that holds taken work
        may exit)."""
        return self.idle_and_stopping() and self.workers.running == 0

    def account(self, msg_type: str, received_at: float, code: str | None = None,
                started_at: float | None = None) -> None:
        """The one place a final reply is counted: in the metrics always, and as a telemetry sample when a
        worker ran it (``started_at``: when it left the queue). ``code`` is the error code, None for ok."""
        now = time.monotonic()
        self.metrics.observe_request(msg_type, now - received_at, code)
        if started_at is not None:
            self.telemetry.request_done(msg_type, now - received_at, started_at - received_at, code)

    def health(self) -> dict[str, Any]:
        rss = psutil.Process().memory_info().rss
        workers = self.workers.health(self._threads, self.worker_stall_s())
        return {
            "ok": workers["workers_ok"],
            "service": self.name,
            "pid": os.getpid(),
            "instance": INSTANCE,
            "protocol": PROTOCOL_VERSION,
            "uptime_s": round(time.monotonic() - self.workers.started, 3),
            "rss_mb": round(rss / 2**20, 1),
            "queue_depth": self.workers.queue.qsize(),
            "running": self.running(),
            **self.metrics.totals(),
            "stopping": self.stopping,
            "metrics_url": self.metrics.url,
            **workers,
            **self.health_details(),
        }

    # --- the life of the process -------------------------------------------------------------
    def stop(self) -> None:
        self._stopping.set()
        for transport in self.transports:
            transport.stop()

    def run(self) -> None:
        data_dir = self.config.runtime.resolved_data_dir()
        if data_dir.is_dir():
            private_dir(data_dir)  # databases, strategy and keys: no other user (nor a tool's uid) reads them
        removed = self._sweep_shm()
        opened: dict[str, Any] = {}
        for transport in self.transports:
            opened.update(transport.open())
        self._serve_metrics()
        self._threads = [threading.Thread(target=self._watched, args=(loop,), name=f"{self.name}-worker-{i}",
                                          daemon=True) for i, loop in enumerate(self.watched_loops())]
        for thread in self._threads:
            thread.start()
        self.telemetry.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        self.serving()
        self.log.info("service_started", pid=os.getpid(), shm_orphans_removed=len(removed), **opened,
                      **self.health_details())
        self._serve_until_drained()
        self._serve_until_threads_end()
        for transport in self.transports:
            transport.close()
        self.log.info("service_stopping", drained=self.workers.queue.empty(), **self.metrics.totals())
        self.metrics.close()
        self.telemetry.stop()
        self.shm_pool.close()
        self.close()
        self.log.info("service_stopped")

    def _serve_until_drained(self) -> None:
        """Poll the transports until stopped and drained (or out of ``drain_timeout_s``)."""
        stop_deadline = None
        last_reap = time.monotonic()
        while True:
            if self.stopping:
                stop_deadline = stop_deadline or time.monotonic() + self.config.runtime.drain_timeout_s
                unanswered = any(t.unanswered() for t in self.transports)
                answered = not unanswered or not any(t.is_alive() for t in self._threads)
                if answered or time.monotonic() > stop_deadline:
                    return
            for transport in self.transports:
                transport.poll(POLL_S)
            if time.monotonic() - last_reap > _REAP_EVERY_S:
                self.shm_pool.reap()
                last_reap = time.monotonic()

    def _serve_until_threads_end(self) -> None:
        """Go on polling while the watched threads finish (they exit once stopping and idle; inference's scheduler
        first writes its sessions to disk), up to ``THREADS_END_S``. Health answers ``stopping`` all the while, so
        a supervisor waits for the exit instead of taking the closed socket of a busy one for a hung one."""
        deadline = time.monotonic() + THREADS_END_S
        while any(t.is_alive() for t in self._threads) and time.monotonic() < deadline:
            for transport in self.transports:
                transport.poll(POLL_S)
        if any(t.is_alive() for t in self._threads):
            self.log.warning("threads_still_running", threads=[t.name for t in self._threads if t.is_alive()])

    def _serve_metrics(self) -> None:
        """Start the HTTP /metrics endpoint if configured; a taken port costs the endpoint, not the service."""
        cfg = self.config.metrics
        if not cfg.enabled:
            return
        try:
            self.log.info("metrics_serving", url=self.metrics.serve_http(cfg.host, cfg.port(self.name),
                                                                         cfg.allowed_hosts))
        except OSError as err:
            self.log.warning("metrics_http_failed", host=cfg.host, port=cfg.port(self.name), error=str(err))

    def _sweep_shm(self) -> list[str]:
        """Unlink dead processes' segments; housekeeping, so whatever goes wrong costs a log line, not the start."""
        try:
            return shm.sweep_orphans()
        except Exception as exc:
            self.log.warning("shm_sweep_failed", error=f"{type(exc).__name__}: {exc}")
            return []

    def _watched(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException:  # a bug in the loop itself: health now says so, and the watchdog restarts us
            self.log.exception("worker_died", worker=threading.current_thread().name)
