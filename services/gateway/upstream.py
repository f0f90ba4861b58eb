"""The services behind the gateway: pooled asyncio clients and a deadline per request.

A ZeroMQ DEALER of ``AsyncClient`` carries one request at a time (a reply whose
id is not the awaited one is dropped), so each HTTP request borrows a client
of its own from a per-service pool and gives it back when its exchange ended
cleanly. A client whose exchange was cut short (the HTTP client went away, the
deadline passed) is closed instead, so no late frame of it meets the next
request. How many HTTP requests run at once is bounded before they get here
(``middleware.Admission``), so the pools are bounded too.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager

from services.gateway.errors import ApiError, bad_request, from_service_error
from shared.client import AsyncClient, ServiceError
from shared.config import Config
from shared.protocol import ErrorCode, Reply, Wire


class Upstreams:
    def __init__(self, config: Config):
        self.config = config
        self.timeout_s = config.gateway.request_timeout_s
        self._idle: dict[str, list[AsyncClient]] = {}

    def deadline(self) -> float:
        """When a request starting now must be done (loop time)."""
        return asyncio.get_running_loop().time() + self.timeout_s

    @asynccontextmanager
    async def client(self, service: str) -> AsyncIterator[AsyncClient]:
        """A client of ``service`` for one exchange."""
        idle = self._idle.setdefault(service, [])
        client = idle.pop() if idle else AsyncClient.for_service(service, self.config, timeout_s=self.timeout_s)
        clean = False
        try:
            yield client
            clean = True
        except ServiceError:
            clean = True  # a typed error reply ends the exchange; the client resets its own socket when needed
            raise
        finally:
            if clean:
                idle.append(client)
            else:
                client.close()

    async def request(self, service: str, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
                      deadline: float | None = None) -> dict:
        """One request's final body; mesh errors and the deadline become ``ApiError``s."""
        with mapped_errors(msg_type):
            return await self.exchange(service, msg_type, body, session_id, deadline)

    async def exchange(self, service: str, msg_type: str, body: dict | Wire | None = None, session_id: str | None = None,
                       deadline: float | None = None) -> dict:
        """One request's final body; a ``ServiceError`` or ``TimeoutError`` as raised (the agent loop takes them)."""
        deadline = deadline if deadline is not None else self.deadline()
        async with self.client(service) as client, asyncio.timeout_at(deadline):
            return await client.request(msg_type, body, session_id)

    async def stream(self, service: str, msg_type: str, body: dict | Wire, session_id: str | None,
                     deadline: float) -> AsyncGenerator[Reply, None]:
        """Every reply frame of one streaming request (events, then the final one), each within the deadline."""
        with mapped_errors(msg_type):
            async with self.client(service) as client:
                frames = client.stream(msg_type, body, session_id)
                try:
                    while True:
                        async with asyncio.timeout_at(deadline):
                            reply = await anext(frames)
                        assert isinstance(reply, Reply)  # no retry is asked for, so no Restart comes
                        yield reply
                        if reply.final:
                            return
                finally:
                    await frames.aclose()

    def close(self) -> None:
        for clients in self._idle.values():
            for client in clients:
                client.close()
        self._idle.clear()


@contextmanager
def mapped_errors(msg_type: str) -> Iterator[None]:
    """Turns what a mesh call raises into the HTTP error a client understands."""
    try:
        yield
    except ServiceError as err:
        raise from_service_error(err) from err
    except TimeoutError as err:
        raise ApiError(504, "timeout_error", ErrorCode.TIMEOUT,
                       f"{msg_type} did not finish within gateway.request_timeout_s") from err
    except (ValueError, OverflowError) as err:  # what msgpack cannot encode: lone surrogates, integers over 64 bits
        raise bad_request(f"the request cannot be encoded: {err}") from err
