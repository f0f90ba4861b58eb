"""The ZeroMQ front of a process: ``ZmqRouter``, a ``Transport`` of the runtime (``runtime.py``).

It owns the ROUTER socket (ZeroMQ sockets are not thread-safe, so only the runtime's thread, which polls it,
touches it): it decodes each frame, answers ``health``, ``metrics`` and ``cancel`` itself, and puts real work on
the runtime's bounded queue. A worker answers through its ``PushSink``, an inproc PUSH socket of its own; this
router forwards each reply to the client. So a long generation never blocks a health check, a full queue
answers ``busy`` instead of growing, and a bad frame costs one error reply, never the process.

``cancel`` marks an accepted request cancelled: a queued one is answered ``cancelled`` instead of running, and
long work asks ``Job.is_cancelled`` as it goes. Request ids are retry-safe (``retries.py``): a request whose
(session, id) is already running is not run again, and a retry of one answered ok gets the remembered reply.
Once the runtime stops, new requests get ``shutting_down``; health and metrics are still answered.

On a tcp endpoint with ``runtime.curve`` the socket is CURVE-encrypted (``shared.security``) and clients are
known by their public key; privileged messages need such a client, or the ipc socket.
"""

from __future__ import annotations

import queue
import time
import uuid
from functools import partial
from typing import Callable, Iterable

import msgpack
import zmq

from shared.config import ipc_path
from shared.metrics import INVALID_TYPE
from shared.protocol import MESSAGES, ErrorCode, ProtocolError, decode_request, encode_error, encode_reply
from shared.security import CurveServer, needs_curve, peers_authenticated, private_dir
from shared.service.retries import RetryMemory, Seen
from shared.service.runtime import Runtime, Transport
from shared.service.workers import Job, Sink


class PushSink:
    """A worker thread's replies, over its own inproc PUSH socket to the router. Each reply is prefixed with a
    frame ``[session, id, kind, type, received_at, started_at, error code]`` for the router's bookkeeping."""

    def __init__(self, socket: zmq.Socket):
        self._socket = socket

    def reply(self, job: Job, kind: str, payload: bytes, code: str | None = None) -> None:
        req = job.request
        bookkeeping = msgpack.packb([req.session, req.id, kind, req.type, job.received_at, job.started_at, code])
        self._socket.send_multipart([bookkeeping] + job.header + [payload])


class ZmqRouter(Transport):
    """The ROUTER socket on ``endpoint``; ``handled()`` names the message types the runtime's workers run."""

    def __init__(self, runtime: Runtime, endpoint: str, handled: Callable[[], Iterable[str]]):
        self.runtime, self.endpoint, self._handled = runtime, endpoint, handled
        self.retries = RetryMemory()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._reply_inproc = f"inproc://replies-{uuid.uuid4().hex}"  # one per router: several may share a process
        self._frontend: zmq.Socket | None = None
        self._replies: zmq.Socket | None = None
        self._poller = zmq.Poller()
        self._curve: CurveServer | None = None
        self._peers_authenticated = False  # set once bound: may privileged messages be served here?
        #: Answered here, never queued behind real work.
        self._inline: dict[str, Callable[[], dict]] = {"health": runtime.health,
                                                         "metrics": runtime.metrics.exposition}

    def with_sink(self, loop: Callable[[Sink], None]) -> Callable[[], None]:
        """``loop`` as a thread's body, answering through a sink of its own (made on that thread)."""
        def run() -> None:
            socket = self._ctx.socket(zmq.PUSH)
            socket.connect(self._reply_inproc)
            try:
                loop(PushSink(socket))
            finally:
                socket.close(linger=1000)  # what it sent last still reaches the router
        return run

    # --- Transport ---------------------------------------------------------------------------
    def open(self) -> dict:
        self._frontend = self._bind()
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._reply_inproc)
        self._poller.register(self._frontend, zmq.POLLIN)
        self._poller.register(self._replies, zmq.POLLIN)
        return {"endpoint": self.endpoint, "curve": self._curve is not None}

    def poll(self, timeout_s: float) -> None:
        assert self._frontend is not None and self._replies is not None
        for sock, _ in self._poller.poll(int(timeout_s * 1000)):
            if sock is self._frontend:
                self._on_frame(self._frontend.recv_multipart(copy=False))
            else:
                self._forward(self._replies.recv_multipart())

    def unanswered(self) -> bool:
        return self.retries.unanswered()

    def close(self) -> None:
        assert self._frontend is not None and self._replies is not None
        while self._replies.poll(100):  # forward what the workers sent last
            self._forward(self._replies.recv_multipart())
        self._frontend.close()
        self._replies.close(linger=0)
        if self._curve is not None:
            self._curve.stop()
        if (path := ipc_path(self.endpoint)) is not None:
            path.unlink(missing_ok=True)

    # --- the socket --------------------------------------------------------------------------
    def _bind(self) -> zmq.Socket:
        path = ipc_path(self.endpoint)
        if path is not None:
            private_dir(path.parent)  # the directory's mode is what keeps other users off the socket
            if path.exists():
                path.unlink()  # a stale socket file from a killed predecessor
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 1000)
        runtime_cfg = self.runtime.config.runtime
        if needs_curve(runtime_cfg, self.endpoint):
            self._curve = CurveServer(self._ctx, runtime_cfg.resolved_keys_dir())
            self._curve.apply(sock)
        self._peers_authenticated = peers_authenticated(self.endpoint, self._curve is not None)
        # Hard ceiling well above the typed TOO_LARGE limit, so a huge frame cannot exhaust memory.
        sock.setsockopt(zmq.MAXMSGSIZE, runtime_cfg.max_frame_bytes * 4)
        sock.bind(self.endpoint)
        return sock

    def _peer(self, frame: zmq.Frame) -> str:
        """Who sent ``frame``: the CURVE client's public key (set by the ZAP handler), else the local account."""
        if self._curve is None:
            return "local"
        try:
            return f"curve:{frame.get('User-Id')}"
        except zmq.ZMQError:  # no user id: cannot happen past a CURVE handshake, but never guess a name
            return "curve:unknown"

    def _send(self, header: list[bytes], payload: bytes) -> None:
        assert self._frontend is not None
        self._frontend.send_multipart(header + [payload])

    def _refuse(self, header: list[bytes], msg_type: str, received_at: float, request_id: str | None, code: str,
                message: str) -> None:
        self.runtime.account(msg_type, received_at, code)
        self._send(header, encode_error(request_id, code, message))

    def _on_frame(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return  # not from a DEALER/REQ peer; nothing to route a reply to
        header, payload = [f.bytes for f in frames[:-1]], frames[-1].bytes
        received_at = time.monotonic()
        runtime = self.runtime
        try:
            req = decode_request(payload, max_frame_bytes=runtime.config.runtime.max_frame_bytes,
                                 handled=set(self._handled()) | set(self._inline) | {"cancel"})
            req.peer = self._peer(frames[-1])
        except ProtocolError as err:
            runtime.log.warning("bad_request", code=err.code, error=err.message)
            self._refuse(header, INVALID_TYPE, received_at, err.request_id, err.code, err.message)
            return
        spec = MESSAGES[req.type]
        if spec.needs_trusted_peer(req) and not self._peers_authenticated:
            runtime.log.warning("unauthorized", type=req.type, endpoint=self.endpoint)
            what = "changes the box" if spec.privileged else "names an owner (speaks for another client)"
            self._refuse(header, req.type, received_at, req.id, ErrorCode.UNAUTHORIZED,
                         f"{req.type} {what}: on a tcp endpoint it needs a CURVE-authenticated client "
                         "(runtime.curve: true and keys from scripts/ops/keys), or use the ipc socket")
            return
        if req.type == "cancel":
            cancelled = self.retries.cancel((req.session, req.body["id"]))
            runtime.account(req.type, received_at)
            self._send(header, encode_reply(req.id, "ok", {"cancelled": cancelled}))
            return
        if req.type in self._inline:
            reply = encode_reply(req.id, "ok", self._inline[req.type]())
            runtime.account(req.type, received_at)
            self._send(header, reply)
            return
        if runtime.stopping:
            self._refuse(header, req.type, received_at, req.id, ErrorCode.SHUTTING_DOWN,
                         f"{runtime.name} is shutting down")
            return
        seen = self.retries.seen(req.key, header)
        if seen is not Seen.NEW:
            runtime.metrics.deduplicated.inc()
            if seen is Seen.ANSWERED:
                self._send(header, self.retries.remembered(req.key))
            return
        try:
            runtime.workers.queue.put_nowait(Job(header, req, received_at,
                                                 is_cancelled=partial(self.retries.is_cancelled, req.key)))
            self.retries.accepted(req.key)
        except queue.Full:
            self._refuse(header, req.type, received_at, req.id, ErrorCode.BUSY,
                         f"{runtime.name} queue is full ({runtime.workers.queue.maxsize}); retry later")

    def _forward(self, frames: list[bytes]) -> None:
        """Send a worker's reply to its client; a final one also to waiting retries, and remember an ok."""
        session, request_id, kind, msg_type, received_at, started_at, code = msgpack.unpackb(frames[0])
        payload = frames[-1]
        if kind == "event":
            self._send(frames[1:-1], payload)
            return
        # Counted before it leaves, so a client holding the reply finds it in the metrics.
        self.runtime.account(msg_type, received_at, code, started_at)
        self._send(frames[1:-1], payload)
        retries = self.retries.answered((session, request_id), kind == "ok", payload)
        if retries is not None:  # the job's one final reply has gone: it stops counting as running
            self.runtime.workers.finished()
        for header in retries or []:
            self._send(header, payload)

