"""The ASGI middlewares around every request: the Host check, admission (how many at once), the body size
limit and the request metrics.

The limit reads the body up front (a declared Content-Length over the limit is
refused before a byte is read) and hands the app the buffered body, so an
oversized request is answered 413 in the error shape whatever the app would
have done with it. (Starlette's own limiter answers plain text, and FastAPI
turns a failure while it reads the body into a 400.) Bodies are small JSON
documents, so buffering costs nothing worth measuring. The buffered body's
nesting is measured before anything parses it (``json_depth``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from collections.abc import Callable
from itertools import accumulate

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.access import OPEN_PATHS, OWNER_KEY, Gateway, authenticate
from services.gateway.errors import ERROR_CODE_KEY, ApiError, bad_request
from shared.protocol import ErrorCode
from shared.security import host_allowed


class HostCheck:
    """Refuses a request whose Host header names none of ``allowed`` (400 ``invalid_host``; ``*`` allows any).

    DNS rebinding: a web page re-points its own name at 127.0.0.1 and then reaches the gateway as if it were its
    own origin, but its requests still carry its own name as Host. (Starlette's TrustedHostMiddleware checks the
    same, but answers in plain text, not in the error shape every other answer has.)"""

    def __init__(self, app: ASGIApp, allowed: set[str], respond: Callable[[ApiError], ASGIApp]):
        self.app = app
        self.allowed = allowed
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = Headers(scope=scope).get("host", "")
            if not host_allowed(header, self.allowed):
                return await self.respond(ApiError(
                    400, "invalid_request_error", "invalid_host",
                    f"Host {header[:100]!r} is not a name of this gateway (gateway.allowed_hosts)"))(scope, receive, send)
        await self.app(scope, receive, send)


class Authenticate:
    """Checks the API key before anything else is spent on a request: a request without a valid key is
    answered 401 before it holds an admission slot or a byte of its body is read, so callers without a key
    cannot lock keyed ones out (32 stalled uploads did). Leaves the caller in ``scope["state"]`` for the
    routes; ``OPEN_PATHS`` need no key."""

    def __init__(self, app: ASGIApp, gw: Gateway, respond: Callable[[ApiError], ASGIApp]):
        self.app = app
        self.gw = gw
        self.respond = respond

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            try:
                owner = authenticate(self.gw, Headers(scope=scope).get("authorization", ""))
            except ApiError as err:
                return await self.respond(err)(scope, receive, send)
            scope.setdefault("state", {})[OWNER_KEY] = owner
        await self.app(scope, receive, send)


#: Requests to ``OPEN_PATHS`` (health, the OpenAPI document) in flight at once: a pool apart from the API's, so
#: no load of API requests starves the watchdog's and compose's health checks, and no flood of open requests
#: takes the API's slots.
OPEN_PATH_SLOTS = 8


class Admission:
    """At most ``limit`` API requests at once, and at most ``per_owner`` of one caller (an API key; keyless
    callers are one caller), each counted from its start to the last byte of its response (a stream's whole
    length); one more is answered 429 at once rather than queued. Open paths have a pool of their own
    (``OPEN_PATH_SLOTS``). ``on_change`` hears the total: the service reports it and drains until it is 0."""

    def __init__(self, app: ASGIApp, limit: int, per_owner: int, respond: Callable[[ApiError], ASGIApp],
                 on_change: Callable[[int], None]):
        self.app = app
        self.limit = limit
        self.per_owner = per_owner
        self.respond = respond
        self.on_change = on_change
        self.open_in_flight = 0
        self.by_owner: Counter[str | None] = Counter()

    @property
    def in_flight(self) -> int:
        return self.open_in_flight + self.by_owner.total()

    def _refusal(self, scope: Scope) -> str | None:
        """Why the request is not admitted now; None when it is."""
        if scope["path"] in OPEN_PATHS:
            return None if self.open_in_flight < OPEN_PATH_SLOTS else \
                f"{OPEN_PATH_SLOTS} health or document requests are in flight"
        owner = scope["state"][OWNER_KEY]
        if self.by_owner.total() >= self.limit:
            return f"the gateway has {self.limit} requests in flight (gateway.max_concurrent)"
        if self.by_owner[owner] >= self.per_owner:
            return f"this caller has {self.per_owner} requests in flight (gateway.max_concurrent_per_key)"
        return None

    def _count(self, scope: Scope, delta: int) -> None:
        if scope["path"] in OPEN_PATHS:
            self.open_in_flight += delta
        else:
            self.by_owner[scope["state"][OWNER_KEY]] += delta
        self.on_change(self.in_flight)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope)
        if refusal is not None:
            return await self.respond(ApiError(429, "rate_limit_error", ErrorCode.BUSY,
                                               f"{refusal}; retry later"))(scope, receive, send)
        self._count(scope, +1)
        try:
            await self.app(scope, receive, send)
        finally:
            self._count(scope, -1)


#: A JSON string, escapes included (a bracket inside one is text).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
#: What each bracket does to the depth.
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth(body: bytes) -> int:
    """How deep the arrays and objects of a JSON document nest, without parsing it: strings are dropped, then
    every byte but brackets, and the deepest running count of what is left is the depth. No recursion, and
    passes at C speed (~20 ms for 1 MiB of brackets). Python's json parser and every walker of its result
    recurse once a level, so a 2 KB body 900 levels deep raised RecursionError (issue 34). Exact for valid
    JSON; malformed JSON is the parser's to refuse."""
    brackets = _JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


class BodyLimit:
    """Reads the whole body before the app runs: at most ``max_bytes`` of it (413), within ``timeout_s`` (408:
    a client that declares a body and stalls holds its slot that long at most), nested at most ``max_depth``
    deep (400)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int, timeout_s: float,
                 respond: Callable[[ApiError], ASGIApp]):
        self.app = app
        self.max_bytes = max_bytes
        self.max_depth = max_depth
        self.timeout_s = timeout_s
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
        try:
            async with asyncio.timeout(self.timeout_s):
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
        except TimeoutError:
            return await self.respond(ApiError(
                408, "invalid_request_error", ErrorCode.TIMEOUT, f"the request body did not arrive within "
                f"{self.timeout_s:g} s (gateway.body_timeout_s)", headers={"Connection": "close"}))(
                    scope, receive, send)
        body = b"".join(chunks)
        if (depth := json_depth(body)) > self.max_depth:
            return await self.respond(bad_request(f"request body nests {depth} levels deep, over "
                                                  f"gateway.max_json_depth ({self.max_depth})"))(scope, receive, send)
        replay: Message | None = {"type": "http.request", "body": body, "more_body": False}

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
