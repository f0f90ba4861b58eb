"""The I/O loop every Magnitude service runs: ``Service``.

One loop owns the ROUTER socket (ZeroMQ sockets are not thread-safe): it
decodes each frame, answers ``health`` and ``metrics`` itself, and puts real work on a bounded
queue. A worker thread runs the handler and sends its replies back over an
inproc PUSH socket; the loop forwards them to the client. So a long generation
never blocks a health check, a full queue answers ``busy`` instead of growing,
and a bad frame costs one error reply, never the process.

What a worker thread may rely on (the queue, heartbeats, ``Answer``) is ``workers.py``. ``health``
answers ``ok: false`` when a worker thread has died or its last beat is older than
``worker_stall_s``, because the I/O loop answering health proves nothing about the
workers; the watchdog then restarts the service as hung.

SIGTERM/SIGINT stop intake (new requests get ``shutting_down``), let queued and
running requests finish, then exit. "Finished" is judged by this loop, not by the
workers: it exits once every request it accepted has had its final reply forwarded,
so a request a worker has taken but not yet counted as running (a first prefill)
is still answered.

``cancel`` (answered by this loop too) marks an accepted request cancelled: a queued one is answered
``cancelled`` instead of running, and a subclass that runs long work checks ``retries.is_cancelled`` as it goes
(the inference scheduler does at every step).

Request ids are retry-safe (``retries.py``): a request whose (session, id) is already running is
not run again, and a retry of one answered ok gets the remembered reply.

Each final reply is recorded in ``self.metrics`` (``shared.metrics``): by type,
error code and latency; they are served over HTTP (``metrics:`` config) and
as the ``metrics`` message. Each request a worker finishes is also reported to the
optimizer as a telemetry sample (``self.telemetry``, ``shared.telemetry``).
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
import uuid
from typing import Any, Callable

import msgpack
import psutil
import zmq

from shared import shm
from shared.config import Config, ipc_path
from shared.logs import configure_logging
from shared.metrics import INVALID_TYPE, metrics_for
from shared.security import CurveServer, needs_curve, peers_authenticated, private_dir
from shared.telemetry import NullTelemetry, Telemetry
from shared.protocol import MESSAGES, PROTOCOL_VERSION, ErrorCode, ProtocolError, decode_request, encode_error, \
    encode_reply
from shared.service.retries import RetryMemory, Seen
from shared.service.workers import Answer, Emitter, Handler, Job, Workers


class Service:
    """Subclass, register handlers with ``handle``, and call ``run``."""

    name = "service"
    worker_threads = 1
    #: Message types a subclass's own ``work_loop`` schedules instead of a registered handler.
    scheduled: frozenset[str] = frozenset()

    def __init__(self, config: Config, endpoint: str | None = None):
        self.config = config
        self.endpoint = endpoint or config.runtime.endpoint(self.name)
        self.log = configure_logging(self.name, config.runtime.log_level)
        self.shm_pool = shm.ShmPool()
        self._handlers: dict[str, Handler] = {}
        self._stopping = threading.Event()
        self.retries = RetryMemory()
        self.workers = Workers(config.runtime.queue_size, self.retries.is_cancelled, self.answer)
        self.metrics = metrics_for(self.name, os.getpid(), queue_depth=self.workers.queue.qsize,
                                   running=lambda: self.running(),
                                   uptime_s=lambda: time.monotonic() - self.workers.started)
        #: Answered by the loop itself, never queued behind real work.
        self._inline: dict[str, Callable[[], dict]] = {"health": self.health, "metrics": self.metrics.exposition}
        self._ctx: zmq.Context = zmq.Context.instance()
        self._reply_inproc = f"inproc://replies-{uuid.uuid4().hex}"  # one per Service: several may share a process
        self._threads: list[threading.Thread] = []
        self._curve: CurveServer | None = None
        self._peers_authenticated = False  # set once bound: may privileged messages be served here?
        self.telemetry = self.make_telemetry()

    # --- to be used / overridden by subclasses -------------------------------------------
    def handle(self, msg_type: str, handler: Handler) -> None:
        if msg_type not in MESSAGES:
            raise ValueError(f"{msg_type!r} is not declared in shared.protocol.MESSAGES")
        self._handlers[msg_type] = handler

    def health_details(self) -> dict[str, Any]:
        """Service-specific health fields (e.g. the model name)."""
        return {}

    def close(self) -> None:
        """Release resources after the loop has stopped."""

    def serving(self) -> None:
        """Called once the socket is bound and the workers run: start here what must not run for a failed start."""

    def worker_stall_s(self) -> float:
        """A worker silent for longer than this is stuck (a service whose jobs may run longer raises it)."""
        return self.config.runtime.worker_stall_s

    def worker_loops(self) -> list[Callable[[zmq.Socket], None]]:
        """What each worker thread runs (it gets its own reply socket): ``worker_threads`` copies of ``work_loop``."""
        return [self.work_loop] * self.worker_threads

    def make_telemetry(self) -> Telemetry:
        """Where this service's samples go: the optimizer (which overrides this: it must not report to itself)."""
        if not self.config.engine.self_optimize:
            return NullTelemetry()
        return Telemetry.for_service(self.name, self.config, queue_depth=self.workers.queue.qsize)

    def running(self) -> int:
        """Requests being worked on: the workers' jobs (a service whose work bypasses the queue overrides this)."""
        return self.workers.running

    def draining(self) -> bool:
        """Accepted work is still unanswered: a stopping service waits for it (up to the drain timeout)."""
        return self.retries.unanswered()

    # --- what worker threads use ----------------------------------------------------------
    def answer(self, job: Job, out: zmq.Socket) -> Answer:
        """The replies to ``job``, over the calling worker's socket ``out``."""
        return Answer(job, out, self.name, self.log)

    def idle_and_stopping(self) -> bool:
        return self._stopping.is_set() and self.workers.queue.empty()

    def work_loop(self, out: zmq.Socket) -> None:
        """One request at a time (``serve``); a service that batches overrides this."""
        while True:
            job = self.workers.next_job(0.2, out)
            if job is None:
                if self.idle_and_stopping():
                    return
                continue
            self.serve(job, out)

    def serve(self, job: Job, out: zmq.Socket) -> None:
        """What ``work_loop`` does with each job: run its handler."""
        self.run_job(job, out)

    def run_job(self, job: Job, out: zmq.Socket) -> None:
        answer = self.answer(job, out)
        try:
            answer.send("ok", self._handlers[job.request.type](job.request, Emitter(answer.send)))
        except Exception as exc:  # a handler bug must cost one request, not the service
            answer.fail(exc)

    # --- the loop ------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        rss = psutil.Process().memory_info().rss
        workers = self.workers.health(self._threads, self.worker_stall_s())
        return {
            "ok": workers["workers_ok"],
            "service": self.name,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "uptime_s": round(time.monotonic() - self.workers.started, 3),
            "rss_mb": round(rss / 2**20, 1),
            "queue_depth": self.workers.queue.qsize(),
            "running": self.running(),
            **self.metrics.totals(),
            "stopping": self._stopping.is_set(),
            "metrics_url": self.metrics.url,
            **workers,
            **self.health_details(),
        }

    def stop(self) -> None:
        self._stopping.set()

    def _bind(self) -> zmq.Socket:
        path = ipc_path(self.endpoint)
        if path is not None:
            private_dir(path.parent)  # the directory's mode is what keeps other users off the socket
            if path.exists():
                path.unlink()  # a stale socket file from a killed predecessor
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        if needs_curve(self.config.runtime, self.endpoint):
            self._curve = CurveServer(self._ctx, self.config.runtime.resolved_keys_dir())
            self._curve.apply(sock)
        self._peers_authenticated = peers_authenticated(self.endpoint, self._curve is not None)
        # Hard ceiling well above the typed TOO_LARGE limit, so a huge frame cannot exhaust memory.
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.runtime.max_frame_bytes * 4)
        sock.bind(self.endpoint)
        return sock

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

    def run(self) -> None:
        data_dir = self.config.runtime.resolved_data_dir()
        if data_dir.is_dir():
            private_dir(data_dir)  # databases, strategy and keys: no other user (nor a tool's uid) reads them
        removed = self._sweep_shm()
        frontend = self._bind()
        self._serve_metrics()
        replies = self._ctx.socket(zmq.PULL)
        replies.bind(self._reply_inproc)
        self._threads = [threading.Thread(target=self._work, args=(loop,), name=f"{self.name}-worker-{i}",
                                          daemon=True) for i, loop in enumerate(self.worker_loops())]
        for w in self._threads:
            w.start()
        self.telemetry.start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        self.serving()
        self.log.info("service_started", endpoint=self.endpoint, pid=os.getpid(), shm_orphans_removed=len(removed),
                      curve=self._curve is not None, **self.health_details())
        poller = zmq.Poller()
        poller.register(frontend, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        stop_deadline = None
        last_reap = time.monotonic()
        while True:
            if self._stopping.is_set():
                stop_deadline = stop_deadline or time.monotonic() + self.config.runtime.drain_timeout_s
                answered = not self.draining() or not any(w.is_alive() for w in self._threads)
                if answered or time.monotonic() > stop_deadline:
                    break
            for sock, _ in poller.poll(100):
                if sock is frontend:
                    self._on_frame(frontend, frontend.recv_multipart(copy=False))
                else:
                    self._forward(frontend, replies.recv_multipart())
            if time.monotonic() - last_reap > 5:
                self.shm_pool.reap()
                last_reap = time.monotonic()
        for w in self._threads:  # they exit once stopping and idle; their sockets flush on close
            w.join(timeout=5)
        while replies.poll(100):  # forward what the workers sent last
            self._forward(frontend, replies.recv_multipart())
        self.log.info("service_stopping", drained=self.workers.queue.empty(), **self.metrics.totals())
        self.metrics.close()
        self.telemetry.stop()
        self.shm_pool.close()
        self.close()
        frontend.close()
        replies.close(linger=0)
        if self._curve is not None:
            self._curve.stop()
        if (path := ipc_path(self.endpoint)) is not None:
            path.unlink(missing_ok=True)
        self.log.info("service_stopped")

    def _sweep_shm(self) -> list[str]:
        """Unlink dead processes' segments; housekeeping, so whatever goes wrong costs a log line, not the start."""
        try:
            return shm.sweep_orphans()
        except Exception as exc:
            self.log.warning("shm_sweep_failed", error=f"{type(exc).__name__}: {exc}")
            return []

    def _account(self, msg_type: str, received_at: float, code: str | None = None,
                 started_at: float | None = None) -> None:
        """The one place a final reply is counted: in the metrics always, and as a telemetry sample when a
        worker ran it (``started_at``: when it left the queue). ``code`` is the error code, None for ok."""
        now = time.monotonic()
        self.metrics.observe_request(msg_type, now - received_at, code)
        if started_at is not None:
            self.telemetry.request_done(msg_type, now - received_at, started_at - received_at, code)

    def _peer(self, frame: zmq.Frame) -> str:
        """Who sent ``frame``: the CURVE client's public key (set by the ZAP handler), else the local account."""
        if self._curve is None:
            return "local"
        try:
            return f"curve:{frame.get('User-Id')}"
        except zmq.ZMQError:  # no user id: cannot happen past a CURVE handshake, but never guess a name
            return "curve:unknown"

    def _on_frame(self, frontend: zmq.Socket, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return  # not from a DEALER/REQ peer; nothing to route a reply to
        header, payload = [f.bytes for f in frames[:-1]], frames[-1].bytes
        received_at = time.monotonic()
        try:
            req = decode_request(payload, max_frame_bytes=self.config.runtime.max_frame_bytes,
                                 handled=set(self._handlers) | self.scheduled | set(self._inline) | {"cancel"})
            req.peer = self._peer(frames[-1])
        except ProtocolError as err:
            self.log.warning("bad_request", code=err.code, error=err.message)
            self._account(INVALID_TYPE, received_at, err.code)
            frontend.send_multipart(header + [encode_error(err.request_id, err.code, err.message)])
            return
        spec = MESSAGES[req.type]
        if spec.needs_trusted_peer(req) and not self._peers_authenticated:
            self.log.warning("unauthorized", type=req.type, endpoint=self.endpoint)
            self._account(req.type, received_at, ErrorCode.UNAUTHORIZED)
            what = "changes the box" if spec.privileged else "names an owner (speaks for another client)"
            frontend.send_multipart(header + [encode_error(
                req.id, ErrorCode.UNAUTHORIZED, f"{req.type} {what}: on a tcp endpoint it needs a CURVE-authenticated "
                "client (runtime.curve: true and keys from scripts/ops/keys), or use the ipc socket")])
            return
        if req.type == "cancel":
            cancelled = self.retries.cancel((req.session, req.body["id"]))
            self._account(req.type, received_at)
            frontend.send_multipart(header + [encode_reply(req.id, "ok", {"cancelled": cancelled})])
            return
        if req.type in self._inline:
            reply = encode_reply(req.id, "ok", self._inline[req.type]())
            self._account(req.type, received_at)
            frontend.send_multipart(header + [reply])
            return
        if self._stopping.is_set():
            self._account(req.type, received_at, ErrorCode.SHUTTING_DOWN)
            frontend.send_multipart(header + [encode_error(req.id, ErrorCode.SHUTTING_DOWN,
                                                           f"{self.name} is shutting down")])
            return
        seen = self.retries.seen(req.key, header)
        if seen is not Seen.NEW:
            self.metrics.deduplicated.inc()
            if seen is Seen.ANSWERED:
                frontend.send_multipart(header + [self.retries.remembered(req.key)])
            return
        try:
            self.workers.queue.put_nowait(Job(header, req, received_at))
            self.retries.accepted(req.key)
        except queue.Full:
            self._account(req.type, received_at, ErrorCode.BUSY)
            frontend.send_multipart(header + [encode_error(
                req.id, ErrorCode.BUSY, f"{self.name} queue is full ({self.workers.queue.maxsize}); retry later")])

    def _forward(self, frontend: zmq.Socket, frames: list[bytes]) -> None:
        """Send a worker's reply to its client; a final one also to waiting retries, and remember an ok.

        Workers prefix each reply with a frame ``[session, id, kind, type, received_at, started_at, error code]``
        for this bookkeeping.
        """
        session, request_id, kind, msg_type, received_at, started_at, code = msgpack.unpackb(frames[0])
        payload = frames[-1]
        if kind == "event":
            frontend.send_multipart(frames[1:])
            return
        # Counted before it leaves, so a client holding the reply finds it in the metrics.
        self._account(msg_type, received_at, code, started_at)
        frontend.send_multipart(frames[1:])
        retries = self.retries.answered((session, request_id), kind == "ok", payload)
        if retries is not None:  # the job's one final reply has gone: it stops counting as running
            self.workers.finished()
        for header in retries or []:
            frontend.send_multipart(header + [payload])

    def _work(self, loop: Callable[[zmq.Socket], None]) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.connect(self._reply_inproc)
        try:
            loop(out)
        except BaseException:  # a bug in the loop itself: health now says so, and the watchdog restarts us
            self.log.exception("worker_died", worker=threading.current_thread().name)
        finally:
            out.close(linger=1000)
