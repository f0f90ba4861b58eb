"""The process skeleton every Magnitude service shares.

One loop owns the ROUTER socket (ZeroMQ sockets are not thread-safe): it
decodes each frame, answers ``health`` and ``metrics`` itself, and puts real work on a bounded
queue. A worker thread runs the handler and sends its replies back over an
inproc PUSH socket; the loop forwards them to the client. So a long generation
never blocks a health check, a full queue answers ``busy`` instead of growing,
and a bad frame costs one error reply, never the process.

Workers beat a heartbeat (``beat``: every loop iteration, every job start and end). ``health``
answers ``ok: false`` when a worker thread has died or its last beat is older than
``worker_stall_s``, because the I/O loop answering health proves nothing about the
workers; the watchdog then restarts the service as hung.

SIGTERM/SIGINT stop intake (new requests get ``shutting_down``), let queued and
running requests finish, then exit. "Finished" is judged by this loop, not by the
workers: it exits once every request it accepted has had its final reply forwarded,
so a request a worker has taken but not yet counted as running (a first prefill)
is still answered.

``cancel`` (answered by this loop too) marks an accepted request cancelled: a queued one is answered
``cancelled`` instead of running, and a subclass that runs long work checks ``is_cancelled`` as it goes
(the inference scheduler does at every step).

Request ids are retry-safe: a request whose (session, id) is already running is
not run again (the retry gets the same final reply), and the last successful
replies are kept, so a client that lost a reply and retries gets it back
without a second execution. This memory does not survive a restart.

Each final reply is recorded in ``self.metrics`` (``shared.metrics``): by type,
error code and latency; they are served over HTTP (``metrics:`` config) and
as the ``metrics`` message. Each request a worker finishes is also reported to the
optimizer as a telemetry sample (``self.telemetry``, ``shared.telemetry``).
"""

from __future__ import annotations

import os
import queue
from collections import OrderedDict
import signal
import threading
import time
import uuid
from dataclasses import dataclass
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
from shared.protocol import (
    MESSAGES,
    PROTOCOL_VERSION,
    ErrorCode,
    ProtocolError,
    Request,
    decode_request,
    encode_error,
    encode_reply,
    internal_error,
)

_REMEMBERED_BYTES = 16 << 20  # budget for remembered ok replies
_REMEMBER_MAX_REPLY = 64 << 10  # bigger replies are not kept (a retry runs again)


class Emitter:
    """What a handler uses to stream ``event`` frames before its final result."""

    def __init__(self, send: Callable[[str, dict], None]):
        self._send = send

    def event(self, body: dict[str, Any]) -> None:
        self._send("event", body)


Handler = Callable[[Request, Emitter], dict]


@dataclass
class Job:
    header: list[bytes]  # ROUTER routing frames, sent back unchanged
    request: Request
    received_at: float
    started_at: float | None = None  # when a worker took it off the queue


class Service:
    """Subclass, register handlers with ``handle``, and call ``run``."""

    name = "service"
    workers = 1
    #: Message types a subclass's own ``work_loop`` schedules instead of a registered handler.
    scheduled: frozenset[str] = frozenset()

    def __init__(self, config: Config, endpoint: str | None = None):
        self.config = config
        self.endpoint = endpoint or config.runtime.endpoint(self.name)
        self.log = configure_logging(self.name, config.runtime.log_level)
        self.shm_pool = shm.ShmPool()
        self._handlers: dict[str, Handler] = {}
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=config.runtime.queue_size)
        self._running_jobs = 0
        self._running_lock = threading.Lock()
        self._stopping = threading.Event()
        self._started = time.monotonic()
        # (session, id) of every accepted request until its final reply is forwarded -> routing headers
        # of retries waiting for the same request
        self._inflight: dict[tuple, list[list[bytes]]] = {}
        self._cancelled: set[tuple] = set()  # keys of accepted requests whose clients cancelled them
        self._done: OrderedDict[tuple, bytes] = OrderedDict()  # (session, id) -> final ok reply frame
        self._done_bytes = 0
        self.metrics = metrics_for(self.name, os.getpid(), queue_depth=self._jobs.qsize,
                                   running=lambda: self._running_jobs,
                                   uptime_s=lambda: time.monotonic() - self._started)
        #: Answered by the loop itself, never queued behind real work.
        self._inline: dict[str, Callable[[], dict]] = {"health": self.health, "metrics": self.metrics.exposition}
        self._ctx = zmq.Context.instance()
        self._reply_inproc = f"inproc://replies-{uuid.uuid4().hex}"  # one per Service: several may share a process
        self._workers: list[threading.Thread] = []
        self._beats: dict[str, float] = {}  # worker thread name -> monotonic time of its last beat
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

    def beat(self) -> None:
        """The calling worker is alive and making progress."""
        self._beats[threading.current_thread().name] = time.monotonic()

    def is_cancelled(self, key: tuple) -> bool:
        """Whether the client of the request ``key`` ((session, id)) cancelled it; safe from any thread."""
        return key in self._cancelled

    def worker_loops(self) -> list[Callable[[zmq.Socket], None]]:
        """What each worker thread runs (it gets its own reply socket): ``workers`` copies of ``work_loop``."""
        return [self.work_loop] * self.workers

    def make_telemetry(self) -> Telemetry:
        """Where this service's samples go: the optimizer (which overrides this: it must not report to itself)."""
        if not self.config.engine.self_optimize:
            return NullTelemetry()
        return Telemetry.for_service(self.name, self.config, queue_depth=self._jobs.qsize)

    # --- the loop ------------------------------------------------------------------------
    def _workers_health(self) -> dict[str, Any]:
        alive = sum(w.is_alive() for w in self._workers)
        now = time.monotonic()
        oldest = max((now - self._beats.get(w.name, self._started) for w in self._workers), default=0.0)
        return {"workers": len(self._workers), "workers_alive": alive, "worker_beat_age_s": round(oldest, 3),
                "workers_ok": alive == len(self._workers) and oldest <= self.worker_stall_s()}

    def health(self) -> dict[str, Any]:
        rss = psutil.Process().memory_info().rss
        workers = self._workers_health()
        return {
            "ok": workers["workers_ok"],
            "service": self.name,
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "uptime_s": round(time.monotonic() - self._started, 3),
            "rss_mb": round(rss / 2**20, 1),
            "queue_depth": self._jobs.qsize(),
            "running": self._running_jobs,
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
            self.log.info("metrics_serving", url=self.metrics.serve_http(cfg.host, cfg.port(self.name)))
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
        self._workers = [threading.Thread(target=self._work, args=(loop,), name=f"{self.name}-worker-{i}",
                                          daemon=True) for i, loop in enumerate(self.worker_loops())]
        for w in self._workers:
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
                answered = not self.draining() or not any(w.is_alive() for w in self._workers)
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
        for w in self._workers:  # they exit once stopping and idle; their sockets flush on close
            w.join(timeout=5)
        while replies.poll(100):  # forward what the workers sent last
            self._forward(frontend, replies.recv_multipart())
        self.log.info("service_stopping", drained=self._jobs.empty(), **self.metrics.totals())
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
        if MESSAGES[req.type].privileged and not self._peers_authenticated:
            self.log.warning("unauthorized", type=req.type, endpoint=self.endpoint)
            self._account(req.type, received_at, ErrorCode.UNAUTHORIZED)
            frontend.send_multipart(header + [encode_error(
                req.id, ErrorCode.UNAUTHORIZED, f"{req.type} changes the box: on a tcp endpoint it needs a "
                "CURVE-authenticated client (runtime.curve: true and keys from scripts/keys), or use the ipc socket")])
            return
        if req.type == "cancel":
            target = (req.session, req.body["id"])
            if target in self._inflight:
                self._cancelled.add(target)
            self._account(req.type, received_at)
            frontend.send_multipart(header + [encode_reply(req.id, "ok", {"cancelled": target in self._cancelled})])
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
        key = (req.session, req.id)
        if key in self._done:
            self.metrics.deduplicated.inc()
            frontend.send_multipart(header + [self._done[key]])
            return
        if key in self._inflight:
            self.metrics.deduplicated.inc()
            self._inflight[key].append(header)
            return
        try:
            self._jobs.put_nowait(Job(header, req, received_at))
            self._inflight[key] = []
        except queue.Full:
            self._account(req.type, received_at, ErrorCode.BUSY)
            frontend.send_multipart(header + [encode_error(
                req.id, ErrorCode.BUSY, f"{self.name} queue is full ({self._jobs.maxsize}); retry later")])

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
        key = (session, request_id)
        self._cancelled.discard(key)
        retries = self._inflight.pop(key, None)
        if retries is not None:  # the job's one final reply has gone: it stops counting as running
            with self._running_lock:
                self._running_jobs -= 1
        for header in retries or []:
            frontend.send_multipart(header + [payload])
        if kind == "ok" and len(payload) <= _REMEMBER_MAX_REPLY and key not in self._done:
            self._done[key] = payload
            self._done_bytes += len(payload)
            while self._done_bytes > _REMEMBERED_BYTES:
                self._done_bytes -= len(self._done.popitem(last=False)[1])

    def _work(self, loop: Callable[[zmq.Socket], None]) -> None:
        out = self._ctx.socket(zmq.PUSH)
        out.connect(self._reply_inproc)
        try:
            loop(out)
        except BaseException:  # a bug in the loop itself: health now says so, and the watchdog restarts us
            self.log.exception("worker_died", worker=threading.current_thread().name)
        finally:
            out.close(linger=1000)

    def next_job(self, timeout_s: float | None, out: zmq.Socket) -> Job | None:
        """The next queued request (waiting up to ``timeout_s``; None or 0 = don't wait), or None. Beats first.
        From here until its final reply the job counts as running. A job cancelled while it waited is answered
        ``cancelled`` on ``out`` and skipped."""
        while True:
            self.beat()
            try:
                job = self._jobs.get(timeout=timeout_s) if timeout_s else self._jobs.get_nowait()
            except queue.Empty:
                return None
            with self._running_lock:
                self._running_jobs += 1
            job.started_at = self._beats[threading.current_thread().name] = time.monotonic()
            if not self.is_cancelled(job.request.key):
                return job
            self.fail(job, out, ProtocolError(ErrorCode.CANCELLED, "cancelled by the client before it ran"))
            timeout_s = 0

    def draining(self) -> bool:
        """Accepted work is still unanswered: a stopping service waits for it (up to the drain timeout)."""
        return bool(self._inflight)

    def running(self) -> int:
        with self._running_lock:
            return self._running_jobs

    def idle_and_stopping(self) -> bool:
        return self._stopping.is_set() and self._jobs.empty()

    def set_running(self, n: int) -> None:
        """For a service whose work does not come through the queue (the gateway's HTTP requests)."""
        with self._running_lock:
            self._running_jobs = n

    def work_loop(self, out: zmq.Socket) -> None:
        """One request at a time (``serve``); a service that batches overrides this."""
        while True:
            job = self.next_job(0.2, out)
            if job is None:
                if self.idle_and_stopping():
                    return
                continue
            self.serve(job, out)

    def serve(self, job: Job, out: zmq.Socket) -> None:
        """What ``work_loop`` does with each job: run its handler."""
        self.run_job(job, out)

    def replier(self, job: Job, out: zmq.Socket) -> Callable[[str, dict], None]:
        """``send(kind, body)`` for one job: ``event``/``ok`` frames back to its client."""
        req = job.request

        def send(kind: str, body: dict) -> None:
            self.send_frame(job, out, kind, encode_reply(req.id, kind, body))
        return send

    def send_frame(self, job: Job, out: zmq.Socket, kind: str, payload: bytes, code: str | None = None) -> None:
        req = job.request
        bookkeeping = msgpack.packb([req.session, req.id, kind, req.type, job.received_at, job.started_at, code])
        out.send_multipart([bookkeeping] + job.header + [payload])

    def fail(self, job: Job, out: zmq.Socket, exc: Exception) -> None:
        """The typed error reply for a failed job; unexpected exceptions are logged as handler bugs."""
        if isinstance(exc, ProtocolError):
            code, message = exc.code, exc.message
        else:
            ref, message = internal_error(self.name, exc)
            self.log.error("handler_failed", type=job.request.type, request_id=job.request.id, ref=ref,
                           exc_info=(type(exc), exc, exc.__traceback__))
            code = ErrorCode.INTERNAL
        self.send_frame(job, out, "error", encode_error(job.request.id, code, message), code)

    def run_job(self, job: Job, out: zmq.Socket) -> None:
        send = self.replier(job, out)
        try:
            send("ok", self._handlers[job.request.type](job.request, Emitter(send)))
        except Exception as exc:  # a handler bug must cost one request, not the service
            self.fail(job, out, exc)
