"""``magnitude mcp serve`` driven by the official MCP SDK's own client, over stdio and over streamable HTTP.

The services run as real processes (the test chat model for the agent); the server is the CLI command, as
a desktop MCP client would start it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import httpx2
import pytest
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from services.gateway.keys import create_key, keys_path
from shared.config import parse_config
from shared.protocol import PRIORITIES
from tests.conftest import (CHAT_MODEL_PATH, REPO, ServiceProcess, make_config, mcp_http_command, require_model,
                            wait_listening, write_config)

ENV = {"PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def stack(run_home):
    require_model(CHAT_MODEL_PATH)
    home = run_home / "mcp-serve"
    home.mkdir()
    base = make_config(home, model_path=str(CHAT_MODEL_PATH), n_ctx=2048)
    config = parse_config({**base.model_dump(mode="json"), "agent": {
        "tools": [{"name": "calculator"}], "memory_collection": "mcp-notes", "max_step_tokens": 48}})
    path = write_config(home, config)
    services = [ServiceProcess(name, path, config).start()
                for name in ("embedding", "retrieval", "tools", "inference")]
    yield config, path
    for svc in reversed(services):
        svc.stop()


def text_of(result) -> str:
    assert not result.is_error, result
    return result.content[0].text


@pytest.mark.model
def test_the_sdk_client_lists_the_tools_searches_memory_and_runs_a_one_step_goal_over_stdio(stack):
    _, path = stack
    server = StdioServerParameters(command=sys.executable, cwd=str(REPO), env=ENV,
                                   args=["-m", "magnitude.cli", "--config", str(path), "mcp", "serve"])

    async def session():
        async with Client(server, cache=None) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert set(tools) == {"memory_search", "memory_add", "calculator", "run_agent"}
            assert tools["run_agent"].input_schema["required"] == ["goal"]
            assert tools["run_agent"].input_schema["properties"]["priority"]["enum"] == list(PRIORITIES)
            for note in ("The spare robot battery is in the hallway cupboard.", "Lena's birthday is in March."):
                assert text_of(await client.call_tool("memory_add", {"text": note})).startswith("stored as ")
            hits = json.loads(text_of(await client.call_tool("memory_search",
                                                              {"query": "Where is the spare battery?", "k": 2})))["hits"]
            assert hits[0]["text"] == "The spare robot battery is in the hallway cupboard.", hits
            assert text_of(await client.call_tool("calculator", {"expression": "23 * 47"})) == "1081"
            bad = await client.call_tool("memory_search", {"query": ""})
            assert bad.is_error
            run = json.loads(text_of(await client.call_tool(
                "run_agent", {"goal": "Reply with one friendly word of greeting.", "max_iterations": 1,
                              "priority": "interactive"})))
            assert run["stopped"] == "final_answer" and run["steps"] == 1 and run["answer"].strip(), run
            return run
    run = asyncio.run(session())
    assert run["session_id"].startswith("agent-")


def test_over_http_it_needs_keys_beyond_loopback_and_then_a_key_on_every_request(run_home):
    config, command, port = mcp_http_command(run_home, "mcp-http")
    refused = subprocess.run(command + ["--host", "0.0.0.0"], capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, **ENV))
    assert refused.returncode == 2 and "api-key" in refused.stderr, refused.stderr
    key = create_key(keys_path(config), "desktop")
    proc = subprocess.Popen(command, env=dict(os.environ, **ENV), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_listening(proc, port, "mcp serve listening")
        url = f"http://127.0.0.1:{port}/mcp"

        async def names(headers: dict) -> set[str]:
            async with httpx2.AsyncClient(headers=headers) as http:
                async with Client(streamable_http_client(url, http_client=http), cache=None) as client:
                    return {t.name for t in (await client.list_tools()).tools}
        assert asyncio.run(names({"Authorization": f"Bearer {key}"})) == {"memory_search", "memory_add",
                                                                         "calculator", "run_agent"}
        with pytest.raises(Exception):
            asyncio.run(names({"Authorization": "Bearer mag-wrong"}))
        with httpx2.Client() as http:
            assert http.post(url, json={}).status_code == 401
    finally:
        proc.terminate()
        proc.wait(10)
