"""``magnitude mcp serve``: the box as an MCP server, so desktop MCP clients and other agents can use it.

Its tools are clients of the running services: ``memory_search`` and ``memory_add`` (the retrieval service,
``agent.memory_collection``), ``calculator`` (the tool service's) and ``run_agent`` (Magnitude's agent loop on
a goal, with the tool service's tools, MCP servers' included). Over stdio by default; over streamable HTTP
with the gateway's API keys: every request needs ``Authorization: Bearer KEY``, loopback too (a first start
makes key ``local`` in keys_dir/local.key, mode 0600). Keyless loopback only with
``gateway.allow_keyless_loopback: true``, logged as a warning.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from pydantic import Field

from magnitude.agent import AsyncAgent, tool_output
from services.gateway.keys import ApiKeys, ensure_local_key, keys_path
from shared.client import AsyncClient, ServiceError
from shared.config import Config
from shared.logs import configure_logging
from shared.protocol import (MAX_AGENT_ITERATIONS, MAX_EXPRESSION_CHARS, MAX_GOAL_CHARS, MAX_HITS, MAX_NOTE_CHARS,
                             MAX_QUERY_CHARS)
from shared.security import LOOPBACK_NAMES

_INSTRUCTIONS = ("Magnitude, an on-device agent stack: search and add to its long-term memory, calculate, or "
                 "hand a whole goal to its agent (run_agent), which uses the box's own tools and model.")


async def _request(config: Config, service: str, msg_type: str, body: dict, timeout_s: float = 60.0) -> dict:
    """One request on a client of its own (a client's socket serves one request at a time); a service's
    error becomes the tool's error."""
    client = AsyncClient.for_service(service, config, timeout_s=timeout_s)
    try:
        return await client.request(msg_type, body)
    except ServiceError as err:
        raise ToolError(f"{service}: {err.code}: {err.message}") from None
    finally:
        client.close()


def build(config: Config) -> MCPServer:
    """The MCP server over ``config``'s services."""
    mcp = MCPServer("magnitude", instructions=_INSTRUCTIONS)
    collection = config.agent.memory_collection

    @mcp.tool()
    async def memory_search(query: Annotated[str, Field(min_length=1, max_length=MAX_QUERY_CHARS)],
                            k: Annotated[int, Field(ge=1, le=MAX_HITS)] = 3) -> dict[str, list[dict[str, Any]]]:
        """Search the box's long-term memory: the stored notes closest in meaning to the query, best first."""
        hits = (await _request(config, "retrieval", "memory.query",
                               {"collection": collection, "text": query, "k": k}))["hits"]
        return {"hits": [{"id": h["id"], "text": h["text"], "score": round(h["score"], 3)} for h in hits]}

    @mcp.tool()
    async def memory_add(text: Annotated[str, Field(min_length=1, max_length=MAX_NOTE_CHARS)]) -> str:
        """Store a note in the box's long-term memory (the agent recalls it when a goal is related)."""
        doc_id = hashlib.sha1(text.encode()).hexdigest()[:16]
        await _request(config, "retrieval", "memory.upsert", {"collection": collection, "id": doc_id, "text": text,
                                                              "metadata": {"source": "mcp"}})
        return f"stored as {doc_id}"

    @mcp.tool()
    async def calculator(expression: Annotated[str, Field(min_length=1, max_length=MAX_EXPRESSION_CHARS)]) -> str:
        """Evaluate arithmetic exactly: + - * / // % **, parentheses, sqrt, round, abs, min, max."""
        return tool_output(await _request(config, "tools", "tool.call",
                                          {"tool": "calculator", "args": {"expression": expression}}))

    @mcp.tool()
    async def run_agent(goal: Annotated[str, Field(min_length=1, max_length=MAX_GOAL_CHARS)],
                        max_iterations: Annotated[int | None, Field(ge=1, le=MAX_AGENT_ITERATIONS)] = None,
                        priority: Literal["interactive", "normal", "background"] = "normal") -> dict[str, Any]:
        """Run Magnitude's agent on a goal: it plans with the box's model and calls the box's tools, then
        answers. Returns the answer, why the run stopped and the tool calls it made. ``priority``: how urgent
        its model steps are beside the box's other work (background work waits for interactive)."""
        agent = AsyncAgent(config, timeout_s=300.0)
        try:
            trace = await agent.run(goal, max_iterations=max_iterations, priority=priority)
        finally:
            agent.close()
        if trace.stopped == "error":
            raise ToolError(f"the agent failed: {trace.error}")
        return {"answer": trace.answer, "stopped": trace.stopped, "session_id": trace.session_id,
                "steps": len(trace.steps), "elapsed_s": trace.elapsed_s,
                "calls": [{"name": c.name, "arguments": c.arguments,
                           **({"output": c.output} if c.error is None else {"error": c.error})}
                          for s in trace.steps for c in s.calls]}

    return mcp


def _guarded(app, keys: ApiKeys, keyless: bool = False):
    """The HTTP app, answering 401 to a request without a valid key (unless keyless was the explicit choice)."""
    async def guarded(scope, receive, send):
        if scope["type"] == "http" and (keys.present() or not keyless):
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not header.startswith("Bearer ") or keys.who(header[7:]) is None:
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"text/plain"), (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": b"an API key is needed: Authorization: Bearer KEY"})
                return
        await app(scope, receive, send)
    return guarded


def serve(config: Config, http_port: int | None, host: str) -> int:
    """Serve over stdio (``http_port`` None) or streamable HTTP at ``host:http_port/mcp``."""
    log = configure_logging("mcp", config.runtime.log_level)  # stderr: stdout carries the protocol
    mcp = build(config)
    if http_port is None:
        mcp.run("stdio")
        return 0
    import uvicorn
    from mcp.server.transport_security import TransportSecuritySettings

    keyless = host in LOOPBACK_NAMES and config.gateway.allow_keyless_loopback
    if keyless:
        log.warning("mcp_keyless", why="gateway.allow_keyless_loopback: every local account can call these tools")
    elif host in LOOPBACK_NAMES and (made := ensure_local_key(config)):
        log.warning("api_key_created", path=str(made), use="Authorization: Bearer $(cat PATH)")
    keys = ApiKeys(keys_path(config))
    if host not in LOOPBACK_NAMES and not keys.present():
        log.error("mcp_refused", host=host, why="serving beyond loopback needs API keys: scripts/ops/keys api-key NAME")
        return 2
    # On loopback the SDK also checks Host and Origin (DNS rebinding); elsewhere the keys guard it.
    app = mcp.streamable_http_app(host=host, transport_security=None if host in LOOPBACK_NAMES else
                                  TransportSecuritySettings(enable_dns_rebinding_protection=False))
    log.info("mcp_serving", url=f"http://{host}:{http_port}/mcp", auth="api_keys" if keys.present() else "none")
    uvicorn.run(_guarded(app, keys, keyless), host=host, port=http_port, log_level="warning",
                log_config=None)  # its records go through our JSON pipeline, tracebacks capped (shared/logs.py)
    return 0
