"""A request's work, cancelled when its HTTP client goes away (the generation with it)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from services.gateway.errors import ApiError
from shared.protocol import ErrorCode

#: How often a non-streamed request checks whether its HTTP client is still there.
DISCONNECT_POLL_S = 0.25

_T = TypeVar("_T")


async def unless_disconnected(http: Request, work: Awaitable[_T]) -> _T:
    """``work``'s result; if the HTTP client goes away first, ``work`` is cancelled (and with it the generation:
    the ZeroMQ client sends ``cancel``), and the request ends as 499, as nginx names a closed request."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await http.is_disconnected():
                raise ApiError(499, "client_closed_request", ErrorCode.CANCELLED, "the client went away")
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
