"""Client library for robot and agent software: sync ``Client`` and asyncio ``AsyncClient``.

Every call has a timeout. A service that is down or silent raises
``ServiceError`` with code ``unavailable`` or ``timeout`` (never a hang), and a
service's own typed error arrives as ``ServiceError`` with its code, so the
caller can choose a fallback. After a timeout the socket is replaced, so a late
reply can never be mistaken for the answer to a later request.

A socket monitor watches the connection: when the service goes away while a
request is in flight (crash, restart), the request fails at once with
``unavailable`` instead of waiting out its timeout, and its socket is replaced
so no frame of it can reach the next request (a disconnect between requests is
harmless: ZeroMQ reconnects by itself). With ``retry=Retry(...)`` a call re-sends on transient failures
with the same request id, which the services deduplicate by (session, id).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message, recv_monitor_message

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
_WATCHED_EVENTS = _HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED

#: Failures worth another try with the same request id: the service may come back or drain its queue.
RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN})


@dataclass(frozen=True)
class Restart:
    """A retried stream yields this before re-sending: drop what the failed attempt streamed."""

    attempt: int  # the attempt about to start (2 = the first retry)
    code: str  # why the previous attempt failed
    message: str
    delay_s: float  # backoff before the re-send


@dataclass(frozen=True)
class Retry:
    """How a call retries transient failures (``RETRYABLE``); other errors are raised at once.

    The backoff doubles from ``first_backoff_s`` up to ``max_backoff_s``. No attempt starts, and no
    attempt waits for its first reply frame, past ``deadline_s`` after the call began: then the
    last error is raised, saying how many attempts were made.
    """

    deadline_s: float = 30.0
    first_backoff_s: float = 0.1
    max_backoff_s: float = 2.0
    on_retry: Callable[[Restart], None] | None = None  # e.g. to log each retry

    def __post_init__(self) -> None:
        if not (self.deadline_s > 0 and 0 < self.first_backoff_s <= self.max_backoff_s):
            raise ValueError(f"Retry needs deadline_s > 0 and 0 < first_backoff_s <= max_backoff_s, got {self}")


class _Attempts:
    """The bookkeeping of one call's attempts: its deadline, the backoff, which errors qualify."""

    def __init__(self, policy: Retry | None):  # None: one attempt, every error is raised
        self.policy = policy
        self.started = time.monotonic()
        self.attempt = 1

    def first_wait_s(self, timeout_s: float) -> float:
        """How long this attempt may wait for its first reply frame."""
        if self.policy is None:
            return timeout_s
        remaining = self.started + self.policy.deadline_s - time.monotonic()
        return max(0.01, min(timeout_s, remaining))

    def restart_after(self, err: ServiceError) -> Restart:
        """The next attempt after ``err``; raises ``err`` when it is final or the deadline would pass."""
        if self.policy is None or err.code not in RETRYABLE:
            raise err
        delay = min(self.policy.max_backoff_s, self.policy.first_backoff_s * 2 ** (self.attempt - 1))
        elapsed = time.monotonic() - self.started
        if elapsed + delay >= self.policy.deadline_s:
            raise ServiceError(err.code, f"{err.message} (gave up after {self.attempt} attempt(s) "
                                         f"in {elapsed:.1f}s)") from err
        self.attempt += 1
        restart = Restart(self.attempt, err.code, err.message, delay)
        if self.policy.on_retry is not None:
            self.policy.on_retry(restart)
        return restart


@dataclass
class GenerateResult:
    text: str
    stats: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_body(cls, body: dict) -> "GenerateResult":
        return cls(body.get("text", ""), {k: v for k, v in body.items() if k != "text"})


def _generate_piece(item: Reply | Restart) -> str | GenerateResult | Restart:
    if isinstance(item, Restart):
        return item
    return GenerateResult.from_body(item.body) if item.final else item.body.get("text", "")


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
    """What the sync and asyncio clients share: endpoint, keys, the socket and its monitor, errors."""

    def __init__(self, endpoint: str, timeout_s: float, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None  # connection events of _sock (_WATCHED_EVENTS)

    @classmethod
    def for_service(cls, service: str, config: Config | None = None, timeout_s: float = 60.0):
        """A client for ``service`` as configured, with CURVE keys where its endpoint requires them."""
        config = config or load_config()
        endpoint = config.runtime.endpoint(service)
        curve = (CurveKeys(config.runtime.resolved_keys_dir(), config.runtime.client_key)
                 if security.needs_curve(config.runtime, endpoint) else None)
        return cls(endpoint, timeout_s=timeout_s, curve=curve)

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._monitor = self._sock.get_monitor_socket(_WATCHED_EVENTS)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                security.apply_curve_client(self._sock, self.curve.keys_dir, self.curve.client_name)
            self._sock.connect(self.endpoint)
        return self._sock

    def close(self) -> None:
        """Drop the socket (and with it any queued or late frames); the next call opens a fresh one."""
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    def _event_error(self, events: list[int], in_flight: bool) -> ServiceError | None:
        """The error that monitor ``events`` mean; a disconnect between requests means nothing
        (ZeroMQ reconnects by itself), one during a request means its reply will never come."""
        if any(e & _HANDSHAKE_FAILED for e in events):
            return ServiceError(ErrorCode.UNAUTHORIZED, f"{self.endpoint} refused the connection handshake "
                                                        "(missing or wrong CURVE key?)")
        if in_flight and zmq.EVENT_DISCONNECTED in events:
            return ServiceError(ErrorCode.UNAVAILABLE, f"{self.endpoint} went away during the request "
                                                       "(service stopped or crashed)")
        return None

    def _check_reachable(self) -> None:
        """An ipc endpoint without its socket file means the service is not running: say so at once."""
        if self.endpoint.startswith("ipc://") and not Path(self.endpoint[len("ipc://"):]).exists():
            raise ServiceError(ErrorCode.UNAVAILABLE, f"no service listening at {self.endpoint}")

    def _timeout(self, msg_type: str, waited_s: float) -> ServiceError:
        return ServiceError(ErrorCode.TIMEOUT,
                            f"no reply to {msg_type!r} from {self.endpoint} within {waited_s:g}s")

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

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, events: list[int], in_flight: bool) -> None:
        error = self._event_error(events, in_flight)
        if error is not None:
            self.close()
            raise error

    def _pending_events(self) -> list[int]:
        events = []
        while self._monitor.poll(0):
            events.append(recv_monitor_message(self._monitor)["event"])
        return events

    def send_raw(self, frame: bytes) -> None:
        """Send one frame as-is (also for tests of hostile input)."""
        self._check_reachable()
        sock = self._socket()
        self._fail(self._pending_events(), in_flight=False)  # forget disconnects of earlier requests
        sock.send(frame)

    def recv_reply(self, request_id: str | None = None, timeout_s: float | None = None,
                   what: str = "request") -> Reply:
        """Next reply frame for ``request_id`` (stale replies of abandoned requests are skipped)."""
        sock = self._socket()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        wait_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(poller.poll(int(remaining * 1000))) if remaining > 0 else {}
            if sock in ready:  # frames that came before a disconnect are still good: read them first
                reply = decode_reply(sock.recv())
                if request_id is None or reply.id == request_id:
                    return reply
            elif self._monitor in ready:
                self._fail(self._pending_events(), in_flight=True)
            else:
                self.close()
                raise self._timeout(what, wait_s)

    def stream(self, msg_type: str, body: dict | None = None, session: str | None = None,
               request_id: str | None = None, retry: Retry | None = None) -> Iterator[Reply | Restart]:
        """Yield every reply frame (events, then the final one) of one request.

        With ``retry``, a transient failure re-sends the request with the same id after a backoff,
        and a ``Restart`` is yielded first: frames of the failed attempt are to be discarded.
        """
        request_id = request_id or new_request_id()
        attempts = _Attempts(retry)
        while True:
            try:
                yield from self._attempt(msg_type, body, session, request_id, attempts)
                return
            except ServiceError as err:
                restart = attempts.restart_after(err)  # or raises err
            yield restart
            time.sleep(restart.delay_s)

    def _attempt(self, msg_type: str, body: dict | None, session: str | None, request_id: str,
                 attempts: _Attempts) -> Iterator[Reply]:
        self.send_raw(encode_request(msg_type, body, session=session, request_id=request_id))
        wait_s = attempts.first_wait_s(self.timeout_s)
        while True:
            reply = self._raise_if_error(self.recv_reply(request_id, timeout_s=wait_s, what=msg_type))
            yield reply
            if reply.final:
                return
            wait_s = None  # the service is answering: from now on each frame gets the full timeout

    def request(self, msg_type: str, body: dict | None = None, session: str | None = None,
                request_id: str | None = None, retry: Retry | None = None) -> dict:
        """Send one request and return the final body."""
        for reply in self.stream(msg_type, body, session, request_id, retry):
            if isinstance(reply, Reply) and reply.final:
                return reply.body
        raise AssertionError("unreachable")

    def health(self) -> dict:
        return self.request("health")

    def generate(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                 **params: Any) -> GenerateResult:
        body = self.request("generate", _generate_body(prompt, session_id, False, params), session_id, retry=retry)
        return GenerateResult.from_body(body)

    def generate_stream(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                        **params: Any) -> Iterator[str | GenerateResult | Restart]:
        """Yield text pieces as they are produced, then one ``GenerateResult`` with the stats.

        With ``retry``, a ``Restart`` means the generation starts over: drop the text so far.
        """
        for item in self.stream("generate", _generate_body(prompt, session_id, True, params), session_id,
                                retry=retry):
            yield _generate_piece(item)


class AsyncClient(_Base):
    """asyncio client for robot stacks; same calls as ``Client``, awaitable."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, curve: CurveKeys | None = None):
        super().__init__(endpoint, timeout_s, curve)
        self._ctx = zmq.asyncio.Context.instance()

    async def _fail(self, in_flight: bool) -> None:
        events = []
        while await self._monitor.poll(0):
            events.append(parse_monitor_message(await self._monitor.recv_multipart())["event"])
        error = self._event_error(events, in_flight)
        if error is not None:
            self.close()
            raise error

    async def _recv_reply(self, request_id: str, timeout_s: float, what: str) -> Reply:
        sock = self._socket()
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            ready = dict(await poller.poll(int(remaining * 1000))) if remaining > 0 else {}
            if sock in ready:  # frames that came before a disconnect are still good: read them first
                reply = decode_reply(await sock.recv())
                if reply.id == request_id:
                    return reply
            elif self._monitor in ready:
                await self._fail(in_flight=True)
            else:
                self.close()
                raise self._timeout(what, timeout_s)

    async def stream(self, msg_type: str, body: dict | None = None, session: str | None = None,
                     request_id: str | None = None, retry: Retry | None = None
                     ) -> AsyncIterator[Reply | Restart]:
        """As ``Client.stream``."""
        request_id = request_id or new_request_id()
        attempts = _Attempts(retry)
        while True:
            try:
                async for reply in self._attempt(msg_type, body, session, request_id, attempts):
                    yield reply
                return
            except ServiceError as err:
                restart = attempts.restart_after(err)  # or raises err
            yield restart
            await asyncio.sleep(restart.delay_s)

    async def _attempt(self, msg_type: str, body: dict | None, session: str | None, request_id: str,
                       attempts: _Attempts) -> AsyncIterator[Reply]:
        self._check_reachable()
        sock = self._socket()
        await self._fail(in_flight=False)  # forget disconnects of earlier requests
        await sock.send(encode_request(msg_type, body, session=session, request_id=request_id))
        wait_s = attempts.first_wait_s(self.timeout_s)
        while True:
            reply = self._raise_if_error(await self._recv_reply(request_id, wait_s, msg_type))
            yield reply
            if reply.final:
                return
            wait_s = self.timeout_s

    async def request(self, msg_type: str, body: dict | None = None, session: str | None = None,
                      request_id: str | None = None, retry: Retry | None = None) -> dict:
        async for reply in self.stream(msg_type, body, session, request_id, retry):
            if isinstance(reply, Reply) and reply.final:
                return reply.body
        raise AssertionError("unreachable")

    async def health(self) -> dict:
        return await self.request("health")

    async def generate(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                       **params: Any) -> GenerateResult:
        body = await self.request("generate", _generate_body(prompt, session_id, False, params), session_id,
                                  retry=retry)
        return GenerateResult.from_body(body)

    async def generate_stream(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                              **params: Any) -> AsyncIterator[str | GenerateResult | Restart]:
        async for item in self.stream("generate", _generate_body(prompt, session_id, True, params), session_id,
                                      retry=retry):
            yield _generate_piece(item)
