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

A request the caller stops waiting for is cancelled: when a call times out, or its stream is closed
before the final reply (a ``break`` out of ``generate_stream``, a cancelled asyncio task), a ``cancel``
frame for its id goes to the service, which frees what the request held (a generation's slot) at once.

The logic lives in ``Call``, which does no I/O (the sans-I/O pattern of h11 and
wsproto): it builds the request frame, says how long to wait, reads what
arrived (a reply frame, monitor events, nothing) and decides what it means,
including whether and when to retry. ``AsyncClient`` only moves bytes between a
ZeroMQ socket and a ``Call``; ``Client`` runs ``AsyncClient``'s calls to completion
on an event loop of its own, so every call is written once.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any, AsyncGenerator, Awaitable, Callable, Iterator, TypeVar

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import security, shm
from shared.config import Config, ipc_path, load_config
from shared.protocol import (ChatRequest, ChatResult, ErrorCode, GenerateRequest, GenerateResult, Message, Reply, Wire,
                             decode_reply, encode_request, new_request_id)


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

#: Over tcp (another box, a LAN inference node) the connection is pinged (ZMTP heartbeats, the Paranoid Pirate's
#: liveness check done by libzmq): a link silent this long is dropped, so a request in flight on it fails
#: ``unavailable`` then instead of waiting out its timeout, while a shorter outage passes unnoticed (TCP resends).
HEARTBEAT_IVL_MS, LINK_TIMEOUT_MS = 2_000, 20_000

#: Failures worth another try with the same request id: the service may come back or drain its queue.
RETRYABLE = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.BUSY, ErrorCode.SHUTTING_DOWN})
#: Failures that leave the socket suspect (a reply may still be on its way, or the peer is gone): replace it.
_RESET_SOCKET = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT, ErrorCode.UNAUTHORIZED})


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


class Call:
    """One request across its attempts, as a state machine without I/O.

    The driver sends ``frame``, then repeatedly waits up to ``wait_s()`` and reports what happened:
    ``on_frame(data)`` (a reply frame: the reply, or None for a stale one), ``on_events(events)``
    (socket monitor events) or ``timed_out()``. Errors come out as ``ServiceError``; ``restart_after``
    turns one into the next attempt's ``Restart`` or raises it when it is final.
    """

    def __init__(self, endpoint: str, msg_type: str, body: dict | Wire | None, session_id: str | None,
                 request_id: str | None, timeout_s: float, retry: Retry | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.endpoint, self.msg_type, self.timeout_s, self.policy, self.clock = (
            endpoint, msg_type, timeout_s, retry, clock)
        self.request_id = request_id or new_request_id()
        self.frame = encode_request(msg_type, body, session=session_id, request_id=self.request_id)
        if (len(self.frame) > shm.INLINE_LIMIT_BYTES and isinstance(body, (GenerateRequest, ChatRequest))
                and security.is_loopback(endpoint)):  # a peer on another box has no view of this one's /dev/shm
            self.frame = encode_request(msg_type, spilled(body, session_id), session=session_id, request_id=self.request_id)
        self.started = clock()
        self.attempt = 1
        self.answering = False  # the current attempt has had a frame: the service is working on it
        self.done = False
        self.outstanding = False  # sent, and no final reply or error yet: the service may be working on it
        self._session_id = session_id
        self._waiting_s = 0.0
        self._wait_until = 0.0

    def wait_s(self) -> float:
        """How long to wait for the next frame: the full timeout once the service answers; before its first
        frame, an attempt also stops at the retry deadline."""
        if self.answering or self.policy is None:
            return self.timeout_s
        remaining = self.started + self.policy.deadline_s - self.clock()
        return max(0.01, min(self.timeout_s, remaining))

    def sent(self) -> None:
        """The driver sent ``frame``."""
        self.outstanding = True

    def cancel_frame(self) -> bytes | None:
        """The ``cancel`` request for this call while the service may still be working on it, else None."""
        if not self.outstanding:
            return None
        self.outstanding = False
        return encode_request("cancel", {"id": self.request_id}, session=self._session_id)

    def expect_frame(self) -> None:
        """The driver starts waiting for the next frame (``poll_ms`` counts down from here)."""
        self._waiting_s = self.wait_s()
        self._wait_until = self.clock() + self._waiting_s

    def poll_ms(self) -> int | None:
        """Milliseconds left to poll for the expected frame; None once the wait is over (``timed_out``)."""
        remaining = self._wait_until - self.clock()
        return int(remaining * 1000) if remaining > 0 else None

    def on_frame(self, data: bytes) -> Reply | None:
        """A frame from the socket: this request's reply (raised when it is an error), or None if stale."""
        reply = decode_reply(data)
        if reply.id != self.request_id:
            return None  # a late reply of an abandoned request
        if reply.final:
            self.outstanding = False
        if reply.kind == "error":
            raise ServiceError(reply.error_code or ErrorCode.INTERNAL, reply.error_message or "")
        self.answering = True
        self.done = reply.final
        return reply

    def on_events(self, events: list[int], in_flight: bool = True) -> None:
        """Monitor events: a refused handshake fails the call; a disconnect fails it while it waits for a reply
        (its reply can no longer come); between requests it means nothing (ZeroMQ reconnects by itself)."""
        if any(e & _HANDSHAKE_FAILED for e in events):
            raise ServiceError(ErrorCode.UNAUTHORIZED, f"{self.endpoint} refused the connection handshake "
                                                       "(missing or wrong CURVE key?)")
        if in_flight and zmq.EVENT_DISCONNECTED in events:
            self.outstanding = False  # the service that had it is gone
            raise ServiceError(ErrorCode.UNAVAILABLE, f"{self.endpoint} went away during the request "
                                                      "(service stopped or crashed, or the link was lost)")

    def timed_out(self) -> ServiceError:
        return ServiceError(ErrorCode.TIMEOUT, f"no reply to {self.msg_type!r} from {self.endpoint} "
                                               f"within {self._waiting_s:g}s")

    def unreachable(self) -> ServiceError | None:
        """An ipc endpoint without its socket file means the service is not running: say so at once."""
        path = ipc_path(self.endpoint)
        if path is not None and not path.exists():
            return ServiceError(ErrorCode.UNAVAILABLE, f"no service listening at {self.endpoint}")
        return None

    def _delay(self) -> float:
        return min(self.policy.max_backoff_s, self.policy.first_backoff_s * 2 ** (self.attempt - 1))

    def will_retry(self, err: ServiceError) -> bool:
        """Whether ``restart_after(err)`` would start another attempt (else ``err`` is final)."""
        return (self.policy is not None and err.code in RETRYABLE
                and self.clock() - self.started + self._delay() < self.policy.deadline_s)

    def restart_after(self, err: ServiceError) -> Restart:
        """The next attempt after ``err``; raises ``err`` when it is final or the deadline would pass."""
        if self.policy is None or err.code not in RETRYABLE:
            raise err
        delay = self._delay()
        elapsed = self.clock() - self.started
        if elapsed + delay >= self.policy.deadline_s:
            raise ServiceError(err.code, f"{err.message} (gave up after {self.attempt} attempt(s) "
                                         f"in {elapsed:.1f}s)") from err
        self.attempt += 1
        self.answering = self.done = False
        restart = Restart(self.attempt, err.code, err.message, delay)
        if self.policy.on_retry is not None:
            self.policy.on_retry(restart)
        return restart


def spilled(body: GenerateRequest | ChatRequest, session_id: str | None) -> GenerateRequest | ChatRequest:
    """A body whose frame is over the inline limit, its bulk (the prompt, the messages) moved to shared memory
    as ``prompt_shm`` / ``messages_shm``: the frame, encoded once, said how big it is. Only for a peer on this
    box (ipc, loopback): to one across the network the frame goes whole, up to its ``max_frame_bytes``."""
    if isinstance(body, GenerateRequest) and body.prompt is not None:
        return msgspec.structs.replace(body, prompt=None, prompt_shm=shm.put_bytes(body.prompt.encode(), session_id=session_id))
    if isinstance(body, ChatRequest) and body.messages is not None:
        return msgspec.structs.replace(body, messages=None, messages_shm=shm.put_bytes(
            msgspec.msgpack.encode(body.messages), session_id=session_id))
    return body


_Body = TypeVar("_Body", GenerateRequest, ChatRequest)


def typed_body(into: type[_Body], **fields: Any) -> _Body:
    """A ``generate`` / ``chat`` body from keywords (those given as None are left out; plain maps such as
    OpenAI-shaped messages become the typed parts). A keyword its type does not declare (``max_token=5``) is a
    TypeError at the call, as Python's own for a misspelt argument; a value it cannot hold is a
    msgspec.ValidationError (a ValueError) there too, before anything is sent."""
    for name in fields:
        if name not in into.__struct_fields__:
            close = get_close_matches(name, into.__struct_fields__, n=1)
            raise TypeError(f"{into.__name__}() got an unexpected keyword argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else ""))
    return msgspec.convert({k: v for k, v in fields.items() if v is not None}, into)


def chat_request(messages: list[dict] | list[Message], **params: Any) -> ChatRequest:
    """A ``chat`` body: ``typed_body`` of the messages and ``ChatRequest``'s other fields."""
    return typed_body(ChatRequest, messages=messages, **params)


def _generate_piece(item: Reply | Restart) -> str | GenerateResult | Restart:
    if isinstance(item, Restart):
        return item
    return item.result(GenerateResult) if item.final else item.body.get("text", "")


def _chat_piece(item: Reply | Restart) -> str | dict | ChatResult | Restart:
    if isinstance(item, Restart):
        return item
    if item.final:
        return item.result(ChatResult)
    return item.body["tool_call"] if "tool_call" in item.body else item.body.get("text", "")


def _final(item: Reply | Restart) -> Reply | None:
    return item if isinstance(item, Reply) and item.final else None


class AsyncClient:
    """asyncio client for robot stacks and the gateway; ``Client`` runs the same calls blocking.

    One DEALER socket (and its monitor), one request in flight at a time: the I/O around a ``Call``."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, curve: CurveKeys | None = None):
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.curve = curve
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None  # connection events of _sock (_WATCHED_EVENTS)

    @classmethod
    def for_service(cls, service: str, config: Config | None = None, timeout_s: float = 60.0) -> "AsyncClient":
        """A client for ``service`` as configured, with CURVE keys where its endpoint requires them."""
        config = config or load_config()
        endpoint = config.runtime.endpoint(service)
        curve = (CurveKeys(config.runtime.resolved_keys_dir(), config.runtime.client_key)
                 if security.needs_curve(config.runtime, endpoint) else None)
        return cls(endpoint, timeout_s=timeout_s, curve=curve)

    def _call(self, msg_type: str, body: dict | Wire | None, session_id: str | None, request_id: str | None,
              retry: Retry | None) -> Call:
        return Call(self.endpoint, msg_type, body, session_id, request_id, self.timeout_s, retry)

    def _socket(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._monitor = self._sock.get_monitor_socket(_WATCHED_EVENTS)
            self._sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None:
                security.apply_curve_client(self._sock, self.curve.keys_dir, self.curve.client_name)
            if self.endpoint.startswith("tcp://"):
                self._sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
                self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, LINK_TIMEOUT_MS)
            self._sock.connect(self.endpoint)
        return self._sock

    def _poller(self) -> zmq.asyncio.Poller:
        """A poller over the socket and its monitor."""
        poller = zmq.asyncio.Poller()
        poller.register(self._socket(), zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        return poller

    def _failed(self, call: Call, err: ServiceError) -> None:
        """After a failure that leaves the socket suspect, drop it: no late frame can reach the next request.
        A call given up on for good (timed out, no retry) is cancelled first; a retry wants its result."""
        if not call.will_retry(err):
            self._cancel(call)
        if err.code in _RESET_SOCKET:
            self.close()

    def _cancel(self, call: Call) -> None:
        """Tell the service to stop working on ``call`` (nothing if it is not outstanding). Sent without
        waiting; the socket then lingers long enough on close to deliver it."""
        frame = call.cancel_frame()
        if frame is None or self._sock is None:
            return
        try:
            self._sock.send(frame, zmq.NOBLOCK)
            self._sock.setsockopt(zmq.LINGER, 500)
        except zmq.ZMQError:
            pass  # the peer is gone or the pipe is full: nothing is running there for us to stop

    def close(self) -> None:
        """Drop the socket (and with it any queued or late frames); the next call opens a fresh one."""
        if self._sock is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = self._monitor = None

    async def _events(self) -> list[int]:
        events = []
        while await self._monitor.poll(0):
            events.append(parse_monitor_message(await self._monitor.recv_multipart())["event"])
        return events

    async def _send(self, call: Call) -> None:
        if (err := call.unreachable()) is not None:
            raise err
        sock = self._socket()
        call.on_events(await self._events(), in_flight=False)  # forget disconnects of earlier requests
        await sock.send(call.frame)
        call.sent()

    async def _next(self, call: Call) -> Reply:
        sock, poller = self._socket(), self._poller()
        call.expect_frame()
        while (ms := call.poll_ms()) is not None:
            ready = dict(await poller.poll(ms))
            if sock in ready:  # frames that came before a disconnect are still good: read them first
                if (reply := call.on_frame(await sock.recv())) is not None:
                    return reply
            elif self._monitor in ready:
                call.on_events(await self._events())
        raise call.timed_out()

    async def stream(self, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
                     request_id: str | None = None, retry: Retry | None = None
                     ) -> AsyncGenerator[Reply | Restart, None]:
        """Yield every reply frame (events, then the final one) of one request.

        With ``retry``, a transient failure re-sends the request with the same id after a backoff,
        and a ``Restart`` is yielded first: frames of the failed attempt are to be discarded.
        """
        call = self._call(msg_type, body, session_id, request_id, retry)
        try:
            while True:
                try:
                    await self._send(call)
                    while not call.done:
                        yield await self._next(call)
                    return
                except ServiceError as err:
                    self._failed(call, err)
                    restart = call.restart_after(err)  # or raises err
                yield restart
                await asyncio.sleep(restart.delay_s)
        finally:  # closed before its final reply (the task was cancelled, the caller stopped listening)
            self._cancel(call)

    async def request(self, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
                      request_id: str | None = None, retry: Retry | None = None) -> dict:
        """Send one request and return the final body."""
        return (await self._final(msg_type, body, session_id, request_id, retry)).body

    async def _final(self, msg_type: str, body: dict | Wire | None, session_id: str | None, request_id: str | None,
                     retry: Retry | None) -> Reply:
        async with aclosing(self.stream(msg_type, body, session_id, request_id, retry)) as items:
            async for item in items:
                if (final := _final(item)) is not None:
                    return final
        raise AssertionError("unreachable: a stream ends with its final reply or raises")

    async def health(self) -> dict:
        return await self.request("health")

    async def generate(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                       **params: Any) -> GenerateResult:
        """A completion of ``prompt``; ``params``: ``GenerateRequest``'s fields (max_tokens, temperature...)."""
        body = typed_body(GenerateRequest, prompt=prompt, **params)
        return (await self._final("generate", body, session_id, None, retry)).result(GenerateResult)

    async def generate_stream(self, prompt: str, session_id: str | None = None, *, retry: Retry | None = None,
                              **params: Any) -> AsyncGenerator[str | GenerateResult | Restart, None]:
        """Yield text pieces as they are produced, then one ``GenerateResult`` with the stats.

        With ``retry``, a ``Restart`` means the generation starts over: drop the text so far.
        """
        body = typed_body(GenerateRequest, prompt=prompt, stream=True, **params)
        async for item in self.stream("generate", body, session_id, retry=retry):
            yield _generate_piece(item)

    async def chat(self, messages: list[dict] | list[Message], session_id: str | None = None, *,
                   retry: Retry | None = None, **params: Any) -> ChatResult:
        """One assistant turn of a conversation (OpenAI-shaped messages; ``ChatRequest``'s fields as keywords:
        ``tools``, ``tool_choice``, ``response_format``, the sampling parameters), rendered with the model's own
        template."""
        body = chat_request(messages, **params)
        return (await self._final("chat", body, session_id, None, retry)).result(ChatResult)

    async def chat_stream(self, messages: list[dict] | list[Message], session_id: str | None = None, *,
                          retry: Retry | None = None,
                          **params: Any) -> AsyncGenerator[str | dict | ChatResult | Restart, None]:
        """Yield content pieces (str) and each tool call once complete (dict: index, id, name, arguments), then one
        ``ChatResult``. With ``retry``, a ``Restart`` means the turn starts over: drop what came so far."""
        async for item in self.stream("chat", chat_request(messages, stream=True, **params), session_id,
                                      retry=retry):
            yield _chat_piece(item)

    # --- raw frames, for tests of hostile input -----------------------------------------------------
    async def send_raw(self, frame: bytes) -> None:
        """Send one frame as-is."""
        await self._raw(self._send, _RawCall(self.endpoint, frame, self.timeout_s))

    async def recv_reply(self, request_id: str | None = None, timeout_s: float | None = None) -> Reply:
        """The next reply frame (for ``request_id`` if given), error replies included, undecided."""
        return await self._raw(self._next, _RawCall(self.endpoint, b"", timeout_s or self.timeout_s, request_id))

    async def _raw(self, step: Callable[[Call], Awaitable[Any]], call: Call) -> Any:
        try:
            return await step(call)
        except ServiceError as err:
            self._failed(call, err)
            raise


class _RawCall(Call):
    """A call that sends a given frame and hands back any reply as it is (``send_raw`` / ``recv_reply``)."""

    def __init__(self, endpoint: str, frame: bytes, timeout_s: float, request_id: str | None = None):
        super().__init__(endpoint, "raw frame", None, None, request_id, timeout_s)
        self.frame, self.any_id = frame, request_id is None

    def on_frame(self, data: bytes) -> Reply | None:
        reply = decode_reply(data)
        return reply if self.any_id or reply.id == self.request_id else None


class Client:
    """Blocking client: every call is ``AsyncClient``'s, run to completion on this client's own event loop, so each
    call has one implementation. One request in flight at a time; inside a running event loop use ``AsyncClient``."""

    def __init__(self, endpoint: str, timeout_s: float = 60.0, curve: CurveKeys | None = None):
        self._async = AsyncClient(endpoint, timeout_s, curve)
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def for_service(cls, service: str, config: Config | None = None, timeout_s: float = 60.0) -> "Client":
        """As ``AsyncClient.for_service``."""
        address = AsyncClient.for_service(service, config, timeout_s)
        return cls(address.endpoint, address.timeout_s, address.curve)

    @property
    def endpoint(self) -> str:
        return self._async.endpoint

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the socket (and with it any queued or late frames); the next call opens a fresh one."""
        self._async.close()
        if self._loop is not None:
            if pending := asyncio.all_tasks(self._loop):  # streams the GC closed meanwhile: let them finish
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()
            self._loop = None

    def _run(self, awaitable: Awaitable[Any]) -> Any:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(awaitable)

    def _iterate(self, items: AsyncGenerator[Any, None]) -> Iterator[Any]:
        """An async iterator, item by item; closing this generator closes it (a stream's cancel)."""
        try:
            while True:
                try:
                    item = self._run(anext(items))
                except StopAsyncIteration:
                    return
                yield item
        finally:  # closing the async iterator sends the request's cancel, unless the client was closed first
            if self._loop is not None and self._loop.is_running():  # the GC closed us inside another call
                self._loop.create_task(items.aclose())
            elif self._loop is not None:
                self._loop.run_until_complete(items.aclose())

    def stream(self, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
               request_id: str | None = None, retry: Retry | None = None) -> Iterator[Reply | Restart]:
        """Yield every reply frame (events, then the final one) of one request: see ``AsyncClient.stream``."""
        return self._iterate(self._async.stream(msg_type, body, session_id, request_id, retry))

    def request(self, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
                request_id: str | None = None, retry: Retry | None = None) -> dict:
        """Send one request and return the final body."""
        return self._run(self._async.request(msg_type, body, session_id, request_id, retry))

    def health(self) -> dict:
        return self.request("health")

    def generate(self, prompt: str, session_id: str | None = None, **params: Any) -> GenerateResult:
        return self._run(self._async.generate(prompt, session_id, **params))

    def generate_stream(self, prompt: str, session_id: str | None = None,
                        **params: Any) -> Iterator[str | GenerateResult | Restart]:
        """Text pieces as they are produced, then one ``GenerateResult``: see ``AsyncClient.generate_stream``."""
        return self._iterate(self._async.generate_stream(prompt, session_id, **params))

    def chat(self, messages: list[dict] | list[Message], session_id: str | None = None, **params: Any) -> ChatResult:
        return self._run(self._async.chat(messages, session_id, **params))

    def chat_stream(self, messages: list[dict] | list[Message], session_id: str | None = None,
                    **params: Any) -> Iterator[str | dict | ChatResult | Restart]:
        """Content pieces and finished tool calls as they come, then one ``ChatResult``: see ``AsyncClient``."""
        return self._iterate(self._async.chat_stream(messages, session_id, **params))

    # --- raw frames, for tests of hostile input -----------------------------------------------------
    def send_raw(self, frame: bytes) -> None:
        """Send one frame as-is."""
        self._run(self._async.send_raw(frame))

    def recv_reply(self, request_id: str | None = None, timeout_s: float | None = None) -> Reply:
        """The next reply frame (for ``request_id`` if given), error replies included, undecided."""
        return self._run(self._async.recv_reply(request_id, timeout_s))
