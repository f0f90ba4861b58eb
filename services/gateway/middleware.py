"""The ASGI middlewares around every request: the Host check, admission (how many at once), the body size
limit and the request metrics.

The limit reads the body up front (a declared Content-Length over the limit is
refused before a byte is read) and hands the app the buffered body, so an
oversized request is answered 413 in the error shape whatever the app would
have done with it. (Starlette's own limiter answers plain text, and FastAPI
turns a failure while it reads the body into a 400.) Bodies are small JSON
documents, so buffering costs nothing worth measuring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.errors import ERROR_CODE_KEY, ApiError
from shared.protocol import ErrorCode


class HostCheck:
    """Refuses a request whose Host header names none of ``allowed`` (400 ``invalid_host``; ``*`` allows any).

    DNS rebinding: a web page re-points its own name at 127.0.0.1 and then reaches the gateway as if it were its
    own origin, but its requests still carry its own name as Host. (Starlette's TrustedHostMiddleware checks the
    same, but answers in plain text, not in the error shape every other answer has.)"""

    def __init__(self, app: ASGIApp, allowed: Iterable[str], respond: Callable[[ApiError], ASGIApp]):
        self.app = app
        self.allowed = {host.lower() for host in allowed}
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and "*" not in self.allowed:
            header = Headers(scope=scope).get("host", "")
            if _host_name(header) not in self.allowed:
                return await self.respond(ApiError(
                    400, "invalid_request_error", "invalid_host",
                    f"Host {header[:100]!r} is not a name of this gateway (gateway.allowed_hosts)"))(scope, receive, send)
        await self.app(scope, receive, send)


def _host_name(header: str) -> str | None:
    """The name a Host header carries ('[::1]:8000' -> '::1'); None when it is not a host[:port]."""
    try:
        return urlsplit(f"//{header}").hostname
    except ValueError:  # an unclosed IPv6 bracket
        return None


class Admission:
    """At most ``limit`` requests at once, every route counted, each from its start to the last byte of its
    response (a stream's whole length); one more is answered 429 at once rather than queued. ``on_change``
    hears the count: the service reports it and drains until it is 0."""

    def __init__(self, app: ASGIApp, limit: int, respond: Callable[[ApiError], ASGIApp],
                 on_change: Callable[[int], None]):
        self.app = app
        self.limit = limit
        self.respond = respond
        self.on_change = on_change
        self.in_flight = 0

    def _count(self, delta: int) -> None:
        self.in_flight += delta
        self.on_change(self.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            return await self.respond(ApiError(
                429, "rate_limit_error", ErrorCode.BUSY, f"the gateway has {self.limit} requests in flight "
                "(gateway.max_concurrent); retry later"))(scope, receive, send)
        self._count(+1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._count(-1)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, respond: Callable[[ApiError], ASGIApp]):
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond  # the error response (itself an ASGI app) for an ApiError

    def _too_large(self, size: str) -> ApiError:
        return ApiError(413, "invalid_request_error", ErrorCode.TOO_LARGE,
                        f"request body of {size} bytes is over gateway.max_body_bytes ({self.max_bytes})")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.respond(self._too_large(declared))(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self.respond(self._too_large(f"over {size}"))(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def buffered() -> Message:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()  # after the body: disconnect notices, for streaming responses

        await self.app(scope, buffered, send)


class Observe:
    """Calls ``record(route, method, status, seconds, error_code)`` once each response has been sent in full
    (a stream's time is its whole length); ``route`` is the route's path template, ``other`` for none."""

    def __init__(self, app: ASGIApp, record: Callable[[str, str, int, float, str | None], None]):
        self.app = app
        self.record = record

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = 500  # what the server answers if the app raises before starting a response

        async def observed(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observed)
        finally:
            route = scope.get("route")
            self.record(getattr(route, "path", "other"), scope["method"], status, time.perf_counter() - started,
                        scope.get("state", {}).get(ERROR_CODE_KEY))
