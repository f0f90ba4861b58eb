"""Who is calling, and which Magnitude session a request belongs to: the dependencies every API route shares.

With API keys configured (or when bound beyond loopback) each request needs
``Authorization: Bearer KEY``; the key's name is the caller. An ``X-Session-Id``
header binds the request to a session (its KV stays warm between steps). A
caller's session ids are scoped by its key name, so two callers never share a
session: ``usage`` reports how many prompt tokens were already cached, and a
shared session would let one caller probe another's prompts that way.

Keys are on from the first start (``ensure_local_key``). Only with
``gateway.allow_keyless_loopback: true`` (loopback only, logged as a warning)
is every local account a caller; then what changes
the box through the gateway is bounded instead: feedback, the optimizer's
privileged message, is rate-limited (``RateLimit``; bodies are bounded by the
schema).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Header
from starlette.requests import Request

from services.gateway.errors import ApiError
from services.gateway.keys import ApiKeys
from services.gateway.schemas import SESSION_PATTERN, Priority
from services.gateway.upstream import Upstreams
from shared.config import Config
from shared.metrics import ServiceMetrics



class RateLimit:
    """A token bucket: ``per_minute`` a minute, in bursts of at most that many. (Ten lines; a rate-limit
    library would be one more runtime package for every offline wheelhouse.)"""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.capacity, self.clock = float(per_minute), clock
        self.tokens, self.last = self.capacity, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.last) * self.capacity / 60)
        self.last = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


@dataclass
class Gateway:
    """What the routes share (``app.state.gateway``)."""

    config: Config
    upstreams: Upstreams
    keys: ApiKeys
    loopback: bool  # bound to a loopback address: keyless possible, as an explicit opt-in
    metrics: ServiceMetrics
    log: Any
    keyless_feedback: RateLimit  # feedback's bound while no key is needed

    def auth_required(self) -> bool:
        return self.keys.present() or not (self.loopback and self.config.gateway.allow_keyless_loopback)


async def gateway(request: Request) -> Gateway:
    return request.app.state.gateway


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, "authentication_error", "invalid_api_key", message,
                    headers={"WWW-Authenticate": "Bearer"})


#: Paths every caller reaches without a key: liveness (the watchdog, compose, a person's curl) and the API's
#: description. They are admitted from a pool of their own (``middleware.Admission``).
OPEN_PATHS = frozenset({"/health", "/openapi.json"})
#: Where ``middleware.Authenticate`` leaves the caller for the routes (``scope["state"]``).
OWNER_KEY = "owner"


def authenticate(gw: Gateway, authorization: str) -> str | None:
    """The name of the key in an ``Authorization`` header; None when no key is needed. 401 for a missing or
    wrong key. Called by ``middleware.Authenticate`` before admission, so a caller without a key never holds a
    request slot (or reads a body) that keyed callers need."""
    if not gw.auth_required():
        return None
    if gw.keys.broken:
        gw.log.error("api_keys_unreadable", path=str(gw.keys.path), error=gw.keys.broken)
    scheme, _, key = authorization.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _unauthorized("this gateway needs an API key: send 'Authorization: Bearer KEY' "
                            "(keys are made with scripts/ops/keys api-key NAME)")
    owner = gw.keys.who(key.strip())
    if owner is None:
        raise _unauthorized("the API key is not valid" if gw.keys.names() else
                            "every API key of this gateway was revoked, so it admits no one: make one with "
                            "scripts/ops/keys api-key NAME")
    return owner


async def request_owner(request: Request) -> str | None:
    """The calling key's name as ``middleware.Authenticate`` found it; None when no key is needed."""
    return request.scope["state"][OWNER_KEY]


def scoped(owner: str | None, session_id: str | None) -> str | None:
    """The mesh session of a caller's session id: the key name is part of it."""
    if session_id is None or owner is None:
        return session_id
    return f"{owner}/{session_id}"


#: The owner the gateway names to inference for every keyless caller (``gateway.allow_keyless_loopback``): one
#: tenant, so together they have one client's ``runtime.max_generations_per_client`` (each borrows a connection
#: of its own, which would count apart) and no KV of the mesh's own local clients. No key can have this name.
KEYLESS = "(keyless)"


def wire_owner(owner: str | None) -> str:
    """Who an inference request is for (its ``owner`` field): the caller's key name, or ``KEYLESS``."""
    return KEYLESS if owner is None else owner


def owned(body: dict[str, Any], owner: str | None) -> dict[str, Any]:
    """An untyped inference request's body naming who it is for (``wire_owner``)."""
    return {**body, "owner": wire_owner(owner)}


SessionHeader = Annotated[str | None, Header(
    alias="X-Session-Id", pattern=SESSION_PATTERN,
    description="binds the request to a Magnitude session: its KV cache stays warm for the next step "
                "(usage.prompt_tokens_details.cached_tokens and timings.cache_n say how much was reused)")]


async def session(owner: Annotated[str | None, Depends(request_owner)],
                  x_session_id: SessionHeader = None) -> str | None:
    return scoped(owner, x_session_id)


PriorityHeader = Annotated[Priority | None, Header(
    alias="X-Priority", description="the request's priority, for clients that cannot add a body field: "
                                    "interactive, normal (default) or background; a body's priority wins")]


Context = Annotated[Gateway, Depends(gateway)]
Owner = Annotated[str | None, Depends(request_owner)]
Session = Annotated[str | None, Depends(session)]
