"""The agent, in process: ``Agent(config).run(goal)`` / ``await AsyncAgent(config).run(goal)`` return a ``Trace``.

The loop itself is ``services.agent.loop`` (below this layer, so the gateway
serves the same loop over HTTP); this module carries its requests to the
services over ZeroMQ, blocking or awaitable, and re-exports what callers use.
"""

from __future__ import annotations

import asyncio
import uuid

from services.agent.loop import SYSTEM_PROMPT, CallRecord, Run, Step, Trace, tool_output, tool_specs
from shared.client import AsyncClient, Client, Retry, ServiceError
from shared.config import Config, load_config

__all__ = ["SYSTEM_PROMPT", "Agent", "AsyncAgent", "CallRecord", "Step", "Trace", "submit_feedback",
           "tool_output", "tool_specs"]

_SERVICES = ("inference", "tools", "retrieval", "optimizer")


class AsyncAgent:
    """asyncio agent for robot software, over the inference, tools, retrieval and optimizer services."""

    def __init__(self, config: Config | None = None, timeout_s: float = 300.0, retry: Retry | None = None):
        """``retry``: re-send each request on transient failures (e.g. a service restart)."""
        self.config = config or load_config()
        self.retry = retry
        self.clients = {name: AsyncClient.for_service(name, self.config, timeout_s=timeout_s) for name in _SERVICES}

    async def run(self, goal: str, session_id: str | None = None, max_iterations: int | None = None,
                  priority: str | None = None) -> Trace:
        """``priority``: every model step's scheduling class (interactive, normal, background)."""
        run = Run(self.config, goal, session_id or f"agent-{uuid.uuid4().hex[:12]}", max_iterations,
                  priority=priority)
        while (req := run.pending) is not None:
            reply: dict | ServiceError
            try:
                reply = await self.clients[req.service].request(req.type, req.body, req.session,
                                                                retry=None if req.optional else self.retry)
            except ServiceError as err:
                reply = err
            run.advance(reply)
        return run.trace

    def close(self) -> None:
        for client in self.clients.values():
            client.close()


class Agent:
    """Blocking agent: ``AsyncAgent``'s run, on an event loop of its own (as ``Client`` runs ``AsyncClient``)."""

    def __init__(self, config: Config | None = None, timeout_s: float = 300.0, retry: Retry | None = None):
        self._async = AsyncAgent(config, timeout_s, retry)
        self.config, self.clients = self._async.config, self._async.clients
        self._loop = asyncio.new_event_loop()

    def run(self, goal: str, session_id: str | None = None, max_iterations: int | None = None,
            priority: str | None = None) -> Trace:
        return self._loop.run_until_complete(self._async.run(goal, session_id, max_iterations, priority))

    def close(self) -> None:
        self._async.close()
        self._loop.close()


def submit_feedback(session_id: str, success: bool, error_reason: str | None = None,
                    details: dict | None = None, config: Config | None = None) -> dict:
    """Tell the optimizer how a run went; returns its ack once the record is on disk."""
    with Client.for_service("optimizer", config or load_config(), timeout_s=10.0) as client:
        return client.request("feedback", {"session_id": session_id, "success": success,
                                           "error_reason": error_reason, "details": details})
