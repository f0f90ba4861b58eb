"""MCP servers' tools for the tool service: one asyncio loop thread holds every server's session.

The tool service is synchronous (worker threads); the official ``mcp`` SDK is asyncio. So one daemon
thread runs an event loop with a supervisor task per configured server: it starts the server (a stdio
command confined like a python/shell tool, or a streamable HTTP URL), lists its tools, lists them again
while it is quiet, and when it exits, stops answering or cannot be reached, ends the session and starts a
new one after a doubling backoff. Meanwhile its tools are reported unavailable and calls to them fail
at once with ``unavailable``. Worker threads call into the loop with ``run_coroutine_threadsafe`` and
wait at most the server's ``timeout_s``; a call that runs out is cancelled and the server checked at once,
so a hung server is restarted while a merely slow tool is not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import re
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jsonschema
from mcp import Client, MCPError, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp_types import CONNECTION_CLOSED, CallToolResult

from services.tools import sandbox
from services.tools.errors import tool_failed
from services.tools.jail import Jail
from shared.config import McpServerConfig, SandboxLimits
from shared.protocol import ProtocolError

#: Pages of ``tools/list`` read per server (a server that pages forever cannot hold the start up).
_MAX_PAGES = 50
#: A session that stayed up this long resets the backoff: it was a crash, not a crash loop.
_STABLE_S = 60.0


@dataclass(frozen=True)
class McpTool:
    """One tool as its server lists it; ``validator`` is None when the server's schema is not a valid one
    (the server then judges the arguments itself)."""

    server: str
    name: str
    description: str
    schema: dict[str, Any]
    validator: Any


def _tool(server: str, listed) -> McpTool:
    schema = listed.input_schema or {"type": "object"}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
        validator = cls(schema)
    except jsonschema.SchemaError:
        validator = None
    return McpTool(server, listed.name, listed.description or listed.title or "", schema, validator)


def offered_names(taken: set[str], tools: list[McpTool]) -> dict[str, McpTool]:
    """The name each MCP tool is offered under: its own (made a valid function name), or ``server_tool``
    when a configured tool or another server's tool has that name too."""
    safe = [re.sub(r"[^A-Za-z0-9_-]", "_", t.name)[:64] for t in tools]
    offered = {}
    for tool, name in zip(tools, safe):
        if name in taken or safe.count(name) > 1:
            name = re.sub(r"[^A-Za-z0-9_-]", "_", f"{tool.server}_{tool.name}")[:64]
        offered[name] = tool
    return offered


def result_text(result: CallToolResult) -> str:
    """A tool result as the text the model reads: text blocks as they are, other blocks named, structured
    content as JSON when there is no text."""
    parts = []
    for block in result.content:
        if block.type == "text":
            parts.append(block.text)
        elif block.type == "image" or block.type == "audio":
            parts.append(f"[{block.type}: {block.mime_type}, {len(block.data) * 3 // 4} bytes]")
        elif block.type == "resource" and hasattr(block.resource, "text"):
            parts.append(block.resource.text)
        else:
            parts.append(f"[resource: {block.uri if block.type == 'resource_link' else block.resource.uri}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


def _reason(exc: BaseException) -> str:
    """One line saying why a session ended (the first leaf of an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return re.sub(r"\s+", " ", f"{type(exc).__name__}: {text}")[:300]


class _Server:
    """One server's supervisor and session; its fields are written on the loop and read from workers."""

    def __init__(self, config: McpServerConfig, limits: SandboxLimits, jail: Jail, log):
        self.config, self.limits, self.jail, self.log = config, limits, jail, log
        self.state = "starting"  # starting | up | down
        self.tools: list[McpTool] = []  # the last listing: kept while down, so the tools show as unavailable
        self.restarts = 0
        self.last_error: str | None = None
        self.retry_at = 0.0
        self.first_attempt = threading.Event()
        self._client: Client | None = None
        self._scope: anyio.CancelScope | None = None
        self._wake: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._lost: str | None = None
        self._http_status: str | None = None  # the last HTTP error status of this session

    # --- on the loop ------------------------------------------------------------------------
    async def supervise(self) -> None:
        self._wake, self._stop = asyncio.Event(), asyncio.Event()
        delay = self.config.backoff_s
        while not self._stop.is_set():
            started = time.monotonic()
            reason = await self._session()
            self.state, self._client, self.last_error = "down", None, reason
            self.first_attempt.set()
            if self._stop.is_set():
                return
            if time.monotonic() - started > _STABLE_S:
                delay = self.config.backoff_s
            self.retry_at = time.monotonic() + delay
            self.log.warning("mcp_server_down", server=self.config.name, reason=reason, restart_in_s=delay)
            with anyio.move_on_after(delay):
                await self._stop.wait()
            delay = min(delay * 2, self.config.backoff_max_s)
            self.restarts += 1

    def stop(self) -> None:
        """End the session and the supervisor (a stdio server's process tree is stopped)."""
        if self._stop is not None:
            self._stop.set()
        self._lose("the tool service is stopping")

    async def _session(self) -> str:
        """Run one session until it ends; returns why it did."""
        cfg = self.config
        self.state, self._lost, self._http_status = "starting", None, None
        reason = None
        with anyio.CancelScope(deadline=anyio.current_time() + cfg.connect_timeout_s) as scope:
            self._scope = scope
            try:
                async with AsyncExitStack() as stack:
                    client = await stack.enter_async_context(Client(await self._transport(stack), cache=None))
                    self.tools = await self._list(client)
                    scope.deadline = math.inf
                    self._client, self.state, self.last_error = client, "up", None
                    self.first_attempt.set()
                    self.log.info("mcp_server_up", server=cfg.name, transport=cfg.transport,
                                  tools=[t.name for t in self.tools])
                    reason = await self._watch(client)
            except Exception as exc:  # the server's failure, whatever the SDK or transport raised
                reason = _reason(exc) + (f" ({self._http_status})" if self._http_status else "")
        if scope.cancelled_caught:
            reason = self._lost or f"not up within connect_timeout_s ({cfg.connect_timeout_s:g} s)"
        return self._lost or reason or "the session ended"

    async def _transport(self, stack: AsyncExitStack):
        cfg = self.config
        if cfg.transport == "http":
            async def note_status(response: httpx2.Response) -> None:  # the SDK's error does not say it
                if response.status_code >= 400:
                    self._http_status = f"HTTP {response.status_code} from {cfg.url}"
            http = await stack.enter_async_context(httpx2.AsyncClient(
                headers=cfg.resolved_headers(), timeout=httpx2.Timeout(cfg.connect_timeout_s, read=None),
                event_hooks={"response": [note_status]}))
            return streamable_http_client(cfg.url, http_client=http)
        command, env = sandbox.confined(sandbox.Call({"argv": cfg.command}, self.limits,
                                                     [Path(r).absolute() for r in cfg.roots], cfg.network),
                                        self.jail)
        cwd = stack.enter_context(tempfile.TemporaryDirectory(prefix="magmcp"))
        return StdioServerParameters(command=command[0], args=command[1:], env={**env, **cfg.env}, cwd=cwd)

    async def _list(self, client: Client, refresh: bool = False) -> list[McpTool]:
        tools, cursor = [], None
        for _ in range(_MAX_PAGES):
            page = await client.list_tools(cursor=cursor, cache_mode="refresh" if refresh else "use")
            tools += [_tool(self.config.name, t) for t in page.tools]
            cursor = page.next_cursor
            if cursor is None:
                break
        return tools

    async def _watch(self, client: Client) -> str:
        """List the tools again whenever the server has been quiet ``check_every_s`` or a call asks (the
        2026 protocol has no ping; a fresh listing also picks up changed tools); returns once that fails."""
        cfg = self.config
        while True:
            with anyio.move_on_after(cfg.check_every_s):
                await self._wake.wait()
            self._wake.clear()
            with anyio.move_on_after(cfg.connect_timeout_s) as check:
                self.tools = await self._list(client, refresh=True)
            if check.cancelled_caught:
                return f"stopped answering (no tool listing within {cfg.connect_timeout_s:g} s)"

    def _lose(self, reason: str) -> None:
        """End the session now (the supervisor then restarts the server)."""
        self._lost = self._lost or reason
        if self._scope is not None:
            self._scope.cancel()

    async def call(self, name: str, args: dict) -> str:
        client = self._client
        if client is None:
            raise self.unavailable()
        try:
            result = await client.call_tool(name, args)
        except MCPError as err:
            if err.code != CONNECTION_CLOSED:  # the server refused the call (unknown tool, bad params): it lives
                raise tool_failed("raised", f"MCP server {self.config.name!r}: {err.message}") from None
            self._lose("the connection closed during a call")
            raise tool_failed("crashed", f"MCP server {self.config.name!r} went away during the call; it is "
                                         "being restarted") from None
        except Exception as exc:  # a transport failure mid-call (HTTP connection refused, pipe broken)
            self._lose(_reason(exc))
            raise tool_failed("crashed", f"MCP server {self.config.name!r} failed during the call "
                                         f"({_reason(exc)}); it is being restarted") from None
        if result.is_error:
            raise tool_failed("raised", f"{name}: {result_text(result)[:1000]}")
        return result_text(result)

    def check(self) -> None:
        """Check the server now (after a call ran out of time: a hung server is restarted, a slow tool is not)."""
        if self._wake is not None:
            self._wake.set()

    # --- from any thread ------------------------------------------------------------------
    def unavailable(self) -> ProtocolError:
        wait = max(0.0, self.retry_at - time.monotonic())
        why = f"{self.state}" + (f" ({self.last_error})" if self.last_error else "")
        return tool_failed("unavailable", f"MCP server {self.config.name!r} is {why}; "
                                          + (f"next start in {wait:.1f} s" if self.state == "down" else "starting"))

    def status(self) -> dict[str, Any]:
        out = {"state": self.state, "transport": self.config.transport, "tools": [t.name for t in self.tools],
               "restarts": self.restarts, "last_error": self.last_error}
        if self.state == "down":
            out["next_start_s"] = round(max(0.0, self.retry_at - time.monotonic()), 1)
        return out


class McpHub:
    """Every configured MCP server, supervised on one background event loop."""

    def __init__(self, servers: list[McpServerConfig], limits: dict[str, SandboxLimits], jail: Jail, log):
        self.servers = {s.name: _Server(s, limits[s.name], jail, log) for s in servers}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-loop", daemon=True)
        self._main: concurrent.futures.Future | None = None

    def start(self, wait_s: float) -> None:
        """Start every server; wait (at most ``wait_s``) until each is up or its first start failed."""
        if not self.servers:
            return
        self._thread.start()
        self._main = asyncio.run_coroutine_threadsafe(self._supervise_all(), self._loop)
        deadline = time.monotonic() + wait_s
        for server in self.servers.values():
            server.first_attempt.wait(max(0.0, deadline - time.monotonic()))

    async def _supervise_all(self) -> None:
        await asyncio.gather(*(s.supervise() for s in self.servers.values()))

    def close(self, timeout_s: float = 15.0) -> None:
        """Stop the supervisors, which ends every session, then the loop."""
        if self._main is None:
            return
        for server in self.servers.values():
            self._loop.call_soon_threadsafe(server.stop)
        try:
            self._main.result(timeout=timeout_s)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)

    def tools(self) -> list[McpTool]:
        """Every tool known from each server's last listing (a server that is down keeps its last)."""
        return [t for s in self.servers.values() for t in s.tools]

    def available(self, tool: McpTool) -> bool:
        return self.servers[tool.server].state == "up"

    def call(self, tool: McpTool, args: dict) -> str:
        """Run ``tool`` on its server within its ``timeout_s``; raises ``tool_failed`` on every failure."""
        server = self.servers[tool.server]
        if server.state != "up":
            raise server.unavailable()
        timeout = server.limits.timeout_s
        future = asyncio.run_coroutine_threadsafe(server.call(tool.name, args), self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            self._loop.call_soon_threadsafe(server.check)
            raise tool_failed("timeout", f"MCP server {tool.server!r} gave no result for {tool.name} within "
                                         f"{timeout:g} s; the call was cancelled") from None

    def status(self) -> dict[str, dict]:
        return {name: s.status() for name, s in self.servers.items()}
