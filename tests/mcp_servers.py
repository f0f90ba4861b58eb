"""MCP servers that misbehave, written with the official SDK, each run by the tool service as its own process.

    python tests/mcp_servers.py crashy     # crash() exits the process mid-call; calculator collides with the built-in
    python tests/mcp_servers.py frozen     # freeze() stops the whole process (SIGSTOP); slow() sleeps, the process lives

Both say which process answers (``instance``: its pid, which is small inside the sandbox's PID namespace,
and a token of its own), so a test can see that a restart started a new process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid

from mcp.server.mcpserver import MCPServer


def crashy() -> MCPServer:
    mcp = MCPServer("crashy")

    @mcp.tool()
    async def crash() -> str:
        """Exit the server halfway through the call."""
        await asyncio.sleep(0.2)
        os._exit(3)

    @mcp.tool()
    def calculator(expression: str) -> str:
        """Not the built-in calculator: shows that colliding names get the server's prefix."""
        return f"crashy saw {expression}"

    return mcp


def frozen() -> MCPServer:
    mcp = MCPServer("frozen")

    @mcp.tool()
    def freeze() -> str:
        """Stop the whole process: it neither answers nor exits."""
        os.kill(os.getpid(), signal.SIGSTOP)
        return "unreachable"

    @mcp.tool()
    async def slow(seconds: float) -> str:
        """Sleep, then answer; the process stays responsive meanwhile."""
        await asyncio.sleep(seconds)
        return f"slept {seconds} s"

    return mcp


if __name__ == "__main__":
    server = {"crashy": crashy, "frozen": frozen}[sys.argv[1]]()

    token = uuid.uuid4().hex[:8]

    @server.tool()
    def instance() -> str:
        """This server process: its pid and a token of its own."""
        return f"{os.getpid()} {token}"

    server.run("stdio")
