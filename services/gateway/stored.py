"""Finished ``/v1/responses`` responses, kept for their caller: read again (``GET``), deleted (``DELETE``), or gone
on by a new user turn (``previous_response_id``), whose run starts from the conversation the response ends.

A kept response holds its run's conversation (``services.agent.loop.Conversation``) and the inference session
the run lived in. The session's KV stays warm for the next turn while the response is its session's latest: a
turn that goes on from it takes the session over (its own response becomes the latest); a turn that goes on
from an older response of that conversation starts a session of its own from that response's conversation (the
same facts and history, a cold KV). Responses are kept for ``gateway.agent_wait_s``, at most
``gateway.max_stored_responses`` in all and ``max_stored_responses_per_key`` per key, the oldest going first: a
cache, so a full one never refuses a request. A session is dropped in inference with the last response that
could go on in it. ``store: false`` keeps nothing.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.agent.loop import Conversation
from services.gateway.errors import ApiError
from services.gateway.schemas import FunctionTool, Response
from shared.config import GatewayConfig


@dataclass(frozen=True)
class StoredResponse:
    owner: str | None  # the key's name: only its caller sees the response
    response: Response
    conversation: Conversation  # as the run left it, its answer included
    session_id: str  # the run's session (not scoped by owner)
    tools: list[FunctionTool]  # the caller's tools of that run: a next turn that sends none keeps them
    instructions: str | None


class Stored:
    def __init__(self, settings: GatewayConfig, drop_session: Callable[[str | None, str], None]):
        self.settings = settings
        self.drop_session = drop_session  # (owner, session_id): frees a session's KV in inference
        self._kept: OrderedDict[str, tuple[StoredResponse, asyncio.TimerHandle]] = OrderedDict()
        self._latest: dict[tuple[str | None, str], str] = {}  # (owner, session) -> the response that holds it

    def keep(self, entry: StoredResponse) -> None:
        """Keep a finished response; it becomes its session's latest. The oldest go when over a cap."""
        mine = [rid for rid, (kept, _) in self._kept.items() if kept.owner == entry.owner]
        for rid in mine[:max(0, len(mine) + 1 - self.settings.max_stored_responses_per_key)]:
            self._forget(rid)
        while len(self._kept) >= self.settings.max_stored_responses:
            self._forget(next(iter(self._kept)))
        rid = entry.response.id
        timer = asyncio.get_running_loop().call_later(self.settings.agent_wait_s, self._forget, rid)
        self._kept[rid] = (entry, timer)
        self._latest[(entry.owner, entry.session_id)] = rid

    def get(self, response_id: str, owner: str | None) -> StoredResponse:
        """The kept response (404 for an unknown one, an expired one, or another caller's)."""
        kept = self._kept.get(response_id)
        if kept is None or kept[0].owner != owner:
            raise ApiError(404, "not_found_error", "response_not_found",
                           f"no response {response_id!r} is kept: unknown, made with store: false, or dropped "
                           "after gateway.agent_wait_s", "previous_response_id")
        return kept[0]

    def go_on(self, response_id: str, owner: str | None) -> tuple[StoredResponse, bool]:
        """The response a new turn goes on from, and whether the turn takes over its session (it is the
        session's latest response): the session then stays until the turn's own response is kept or it ends."""
        entry = self.get(response_id, owner)
        warm = self._latest.get((owner, entry.session_id)) == response_id
        if warm:
            del self._latest[(owner, entry.session_id)]
        return entry, warm

    def delete(self, response_id: str, owner: str | None) -> None:
        self.get(response_id, owner)
        self._forget(response_id)

    def _forget(self, response_id: str) -> None:
        entry, timer = self._kept.pop(response_id)
        timer.cancel()
        if self._latest.get((entry.owner, entry.session_id)) == response_id:
            del self._latest[(entry.owner, entry.session_id)]
            self.drop_session(entry.owner, entry.session_id)
