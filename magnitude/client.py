"""Client library for robot and agent software: sync ``Client`` and asyncio ``AsyncClient``.

Every call has a timeout. A service that is down or silent raises
``ServiceError`` with code ``unavailable`` or ``timeout`` (never a hang), and a
service's own typed error arrives as ``ServiceError`` with its code, so the
caller can choose a fallback. After a timeout the socket is replaced, so a late
reply can never be mistaken for the answer to a later request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Iterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from shared import shm
from shared import security
from shared.config import Config, load_config
from shared.protocol import ErrorCode, Reply, decode_reply, encode_request, new_request_id


class ServiceError(Exception):
    """A typed failure: the service's error reply, or ``timeout`` / ``unavailable`` raised here."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class CurveKeys:
    """Where this client's CURVE keypair and the server's public key live (see shared.security)."""

    keys_dir: Path
    client_name: str


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class GenerateResult:
    text: str
    stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict) -> "GenerateResult":
        return cls(body.get("text", ""), {k: v for k, v in body.items() if k != "text"})


def _generate_body(prompt: str, session: str | None, stream: bool, params: dict[str, Any]) -> dict[str, Any]:
    body = {k: v for k, v in params.items() if v is not None}
    body["stream"] = stream
    encoded = prompt.encode()
    if len(encoded) > shm.INLINE_LIMIT_BYTES:
        body["prompt_shm"] = shm.put_bytes(encoded, session=session)
    else:
        body["prompt"] = prompt
    return body


class _Base:
    def __init__(self, endpoint: str, timeout_s: float, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve

    @classmethod
    def for_service(cls, service: str, config: Config | None = None, timeout_s: float = 60.0):
        """A client for ``service`` as configured, with CURVE keys where its endpoint requires them."""
        config = config or load_config()
        endpoint = config.runtime.endpoint(service)
        curve = (CurveKeys(config.runtime.resolved_keys_dir(), config.runtime.client_key)
                 if security.needs_curve(config.runtime, endpoint) else None)
        return cls(endpoint, timeout_s=timeout_s, curve=curve)

    def _configure(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve is not None:
            security.apply_curve_client(sock, self.curve.keys_dir, self.curve.client_name)
        sock.connect(self.endpoint)

    def _refused(self) -> ServiceError:
        return ServiceError(ErrorCode.UNAUTHORIZED,
                            f"{self.endpoint} refused the connection handshake (missing or wrong CURVE key?)")

    def _check_reachable(self) -> None:
        """An ipc endpoint without its socket file means the service is not running: say so at once."""
        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[len("ipc://"):]).exists():
            raise ServiceError(ErrorCode.UNAVAILABLE, f"no service listening at {self.endpoint}")

    def _timeout(self, msg_type: str) -> ServiceError:
        return ServiceError(ErrorCode.TIMEOUT,
                            f"no reply to {msg_type!r} from {self.endpoint} within {self.timeout_s:g}s")

    @staticmethod
    def _raise_if_error(reply: Reply) -> Reply:
        if reply.kind == "error":
            raise ServiceError(reply.error_code or ErrorCode.INTERNAL, reply.error_message or "")
        return reply


class Client(_Base):
    """Blocking client; one DEALER socket, one request in flight at a time."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, curve: CurveKeys | None = None):
        super().__init__(endpoint, timeout_s, curve)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            if self.endpoint.startswith("tcp://"):  # only tcp has handshakes that can be refused
                self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)
            self._configure(self._sock)
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            if self._monitor is not None:
                self._sock.disable_monitor()
                self._monitor.close(linger=0)
                self._monitor = None
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_raw(self, frame: bytes) -> None:
        """Send one frame as-is (for tests of hostile input)."""
        self._check_reachable()
        self._socket().send(frame)

    def recv_reply(self, request_id: str | None = None, timeout_s: float | None = None,
                   what: str = "request") -> Reply:
        """Next reply frame for ``request_id`` (stale replies of abandoned requests are skipped)."""
        sock = self._socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(poller.poll(int(remaining * 1000))) if remaining > 0 else {}
            if self._monitor is not None and self._monitor in ready:
                recv_monitor_message(self._monitor)
                self._reset()
                raise self._refused()
            if sock not in ready:
                self._reset()
                raise self._timeout(what)
            reply = decode_reply(sock.recv())
            if request_id is None or reply.id == request_id:
                return reply

    def stream(self, msg_type: str, body: dict | None = None, session: str | None = None,
               request_id: str | None = None) -> Iterator[Reply]:
        """Yield every reply frame (events, then the final one) of one request."""
        self._check_reachable()
        request_id = request_id or new_request_id()
        self._socket().send(encode_request(msg_type, body, session=session, request_id=request_id))
        while True:
            reply = self._raise_if_error(self.recv_reply(request_id, what=msg_type))
            yield reply
            if reply.final:
                return

    def request(self, msg_type: str, body: dict | None = None, session: str | None = None,
                request_id: str | None = None) -> dict:
        """Send one request and return the final body."""
        for reply in self.stream(msg_type, body, session, request_id):
            if reply.final:
                return reply.body
        raise AssertionError("unreachable")

    def health(self) -> dict:
        return self.request("health")

    def generate(self, prompt: str, session_id: str | None = None, **params: Any) -> GenerateResult:
        return GenerateResult.from_body(self.request("generate", _generate_body(prompt, session_id, False, params), session_id))

    def generate_stream(self, prompt: str, session_id: str | None = None, **params: Any
                        ) -> Iterator[str | GenerateResult]:
        """Yield text pieces as they are produced, then one ``GenerateResult`` with the stats."""
        for reply in self.stream("generate", _generate_body(prompt, session_id, True, params), session_id):
            yield GenerateResult.from_body(reply.body) if reply.final else reply.body.get("text", "")


class AsyncClient(_Base):
    """asyncio client for robot stacks; same calls as ``Client``, awaitable."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, curve: CurveKeys | None = None):
        super().__init__(endpoint, timeout_s, curve)
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._configure(self._sock)
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def stream(self, msg_type: str, body: dict | None = None, session: str | None = None,
                     request_id: str | None = None) -> AsyncIterator[Reply]:
        self._check_reachable()
        request_id = request_id or new_request_id()
        sock = self._socket()
        await sock.send(encode_request(msg_type, body, session=session, request_id=request_id))
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not await sock.poll(int(remaining * 1000)):
                self.close()
                raise self._timeout(msg_type)
            reply = decode_reply(await sock.recv())
            if reply.id != request_id:
                continue
            yield self._raise_if_error(reply)
            if reply.final:
                return
            deadline = time.monotonic() + self.timeout_s

    async def request(self, msg_type: str, body: dict | None = None, session: str | None = None,
                      request_id: str | None = None) -> dict:
        async for reply in self.stream(msg_type, body, session, request_id):
            if reply.final:
                return reply.body
        raise AssertionError("unreachable")

    async def health(self) -> dict:
        return await self.request("health")

    async def generate(self, prompt: str, session_id: str | None = None, **params: Any) -> GenerateResult:
        body = await self.request("generate", _generate_body(prompt, session_id, False, params), session_id)
        return GenerateResult.from_body(body)

    async def generate_stream(self, prompt: str, session_id: str | None = None, **params: Any
                              ) -> AsyncIterator[str | GenerateResult]:
        async for reply in self.stream("generate", _generate_body(prompt, session_id, True, params), session_id):
            yield GenerateResult.from_body(reply.body) if reply.final else reply.body.get("text", "")
