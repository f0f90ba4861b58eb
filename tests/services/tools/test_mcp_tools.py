"""MCP servers' tools in the tool service, against real servers written with the official SDK, each its own process.

A stdio robot server (started sandboxed by the tool service), the same robot over streamable HTTP (its own
process, reached with a key from the environment), one that exits mid-call and one that stops answering:
every failure is a typed error within the call's timeout, a dead or hung server is restarted, the service
answers health throughout, and an agent run goes on past a failed call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from services.agent.loop import Run, ServiceCall
from shared.client import Client, ServiceError
from shared.config import parse_config
from tests.conftest import REPO, ServiceProcess, chat_reply, free_port, wait_for, wait_listening, write_config

ROBOT = REPO / "examples" / "mcp" / "home_robot.py"
MISBEHAVING = REPO / "tests" / "mcp_servers.py"
KEY = "robot-key-1234"


@pytest.fixture(scope="module")
def http_robot():
    """The robot server over streamable HTTP on loopback, needing a key: its own process, as in compose."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROBOT), "--http", str(port)], env=dict(os.environ, MCP_KEY=KEY),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    wait_listening(proc, port, "the HTTP MCP server listening")
    yield f"http://127.0.0.1:{port}/mcp"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def tools(run_home, http_robot):
    home = run_home / "mcp-tools"
    home.mkdir()
    stdio = {"roots": [str(REPO / "examples" / "mcp"), str(REPO / "tests")], "connect_timeout_s": 5,
             "backoff_s": 0.5}
    config = parse_config({
        "agent": {"tools": [{"name": "calculator"}], "mcp_servers": [
            {"name": "robot", "command": [sys.executable, str(ROBOT)], **stdio},
            {"name": "remote", "url": http_robot, "headers": {"Authorization": "Bearer ${TEST_MCP_KEY}"}},
            {"name": "locked", "url": http_robot, "headers": {"Authorization": "Bearer wrong"},
             "connect_timeout_s": 5, "backoff_s": 60},
            {"name": "crashy", "command": [sys.executable, str(MISBEHAVING), "crashy"], **stdio, "backoff_s": 4},
            {"name": "frozen", "command": [sys.executable, str(MISBEHAVING), "frozen"], **stdio,
             "connect_timeout_s": 3, "limits": {"timeout_s": 2}}]},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False},
    })
    path = write_config(home, config)
    os.environ["TEST_MCP_KEY"] = KEY  # the service process inherits it: the key is not in the YAML
    try:
        svc = ServiceProcess("tools", path, config).start()
    finally:
        del os.environ["TEST_MCP_KEY"]
    client = Client(svc.endpoint, timeout_s=30)
    yield client, path, svc
    client.close()
    svc.stop()
    assert svc.proc.returncode == 0, svc.log.read_text()[-3000:]


def listed(client) -> dict:
    return {t["name"]: t for t in client.request("tool.list")["tools"]}


def call(client, tool, **args):
    return client.request("tool.call", {"tool": tool, "args": args})


def mcp_state(client, server) -> dict:
    return client.health()["mcp"][server]


def failing(client, tool, **args) -> tuple[ServiceError, float]:
    """The typed error a call ends in, and the seconds it took."""
    started = time.monotonic()
    with pytest.raises(ServiceError) as err:
        call(client, tool, **args)
    return err.value, time.monotonic() - started


def instance(client, server) -> str:
    return call(client, f"{server}_instance")["output"]


def processes(kind: str) -> set[int]:
    """Host pids of a misbehaving server's processes (the sandbox's and the server's own)."""
    return {p.pid for p in psutil.process_iter(["cmdline"])
            if str(MISBEHAVING) in " ".join(p.info["cmdline"] or []) and kind in " ".join(p.info["cmdline"] or [])}


def test_servers_tools_are_listed_with_their_schemas_and_prefixed_where_names_collide(tools):
    client, _, _ = tools
    names = listed(client)
    # The robot's tools exist on two servers: each gets its server's prefix. So do crashy's calculator (the
    # built-in has the name) and the instance tool both misbehaving servers have; unique names stay as they are.
    for name in ("robot_move_to", "remote_move_to", "robot_read_sensor", "remote_read_sensor", "crashy_calculator",
                 "crashy_instance", "frozen_instance", "crash", "freeze", "slow"):
        assert names[name]["kind"] == "mcp" and names[name]["available"], names.get(name)
    assert names["calculator"]["kind"] == "builtin"
    assert names["remote_move_to"]["server"] == "remote"
    room = names["robot_move_to"]["parameters"]["properties"]["room"]
    assert "garage" in room["enum"] and names["robot_move_to"]["parameters"]["required"] == ["room"]
    assert "battery" in names["robot_move_to"]["description"]
    health = client.health()
    assert health["ok"] and health["mcp"]["robot"]["state"] == "up" and health["mcp"]["remote"]["state"] == "up"
    assert "robot_move_to" in health["tools"]
    if health["tool_isolation"]["isolation"] == "bubblewrap":  # a stdio server runs in its own PID namespace
        assert instance(client, "crashy").split()[0] == "2"


def test_stdio_and_http_tools_are_called_and_bad_arguments_never_reach_the_server(tools):
    client, _, _ = tools
    assert call(client, "robot_move_to", room="garage")["output"] == \
        "Arrived in the garage after driving 38 m. Battery: 79%."
    reading = call(client, "remote_read_sensor", room="bathroom", sensor="humidity")
    assert reading["output"] == "humidity in the bathroom: 64 % relative humidity" and not reading["truncated"]
    assert call(client, "crashy_calculator", expression="1+1")["output"] == "crashy saw 1+1"
    assert call(client, "calculator", expression="1+1")["output"] == "2"  # the built-in keeps its name
    with pytest.raises(ServiceError) as err:
        call(client, "robot_move_to", room="attic")
    assert err.value.code == "bad_request" and "room" in err.value.message
    with pytest.raises(ServiceError) as err:
        call(client, "teleport", room="garage")
    assert err.value.code == "not_found"


def test_an_http_server_refusing_the_key_is_down_with_the_reason_and_offers_nothing(tools):
    client, path, _ = tools
    locked = mcp_state(client, "locked")
    assert locked["state"] == "down" and locked["tools"] == [] and "401" in locked["last_error"], locked
    out = subprocess.run([sys.executable, "-m", "magnitude.cli", "--config", str(path), "health", "--service", "tools"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert "locked:down" in out.stdout and "robot:up" in out.stdout, out.stdout + out.stderr


def test_a_server_that_exits_mid_call_fails_the_call_typed_is_reported_unavailable_and_restarted(tools):
    client, path, _ = tools
    before, old = instance(client, "crashy"), processes("crashy")
    err, seconds = failing(client, "crash")
    assert err.code == "tool_failed" and err.message.startswith("crashed:") and seconds < 5, err.message
    # Until its restart (backoff 4 s) its tools are listed unavailable, and calls fail at once.
    out = subprocess.run([sys.executable, "-m", "magnitude.cli", "--config", str(path), "tools"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    crash_line = next(line for line in out.stdout.splitlines() if line.startswith("crash "))
    assert "unavailable" in crash_line, out.stdout
    assert not listed(client)["crashy_instance"]["available"]
    with pytest.raises(ServiceError) as err:
        instance(client, "crashy")
    assert err.value.message.startswith("unavailable:") and "crashy" in err.value.message
    assert call(client, "robot_move_to", room="hall")["output"].startswith("Arrived in the hall")  # others serve on
    wait_for(lambda: mcp_state(client, "crashy")["state"] == "up", 30, "crashy restarted")
    assert instance(client, "crashy") != before and old and not any(psutil.pid_exists(p) for p in old)
    assert mcp_state(client, "crashy")["restarts"] >= 1


def test_a_slow_tool_times_out_typed_and_its_server_stays(tools):
    client, _, _ = tools
    before = instance(client, "frozen")
    err, seconds = failing(client, "slow", seconds=30)
    assert err.message.startswith("timeout:") and 2 <= seconds < 4, err.message
    assert call(client, "slow", seconds=0.1)["output"] == "slept 0.1 s"
    assert instance(client, "frozen") == before and mcp_state(client, "frozen")["restarts"] == 0


def test_a_server_that_never_answers_again_is_killed_and_restarted_without_holding_the_service(tools):
    client, _, _ = tools
    before, old = instance(client, "frozen"), processes("frozen")
    err, seconds = failing(client, "freeze")
    assert err.message.startswith("timeout:") and seconds < 4, err.message
    assert psutil.STATUS_STOPPED in {psutil.Process(p).status() for p in old}
    # Health and the other servers answer while it is hung; the check after the timeout finds it silent.
    assert client.health()["ok"]
    assert call(client, "remote_door_state", door="back")["output"] == "The back door is unlocked."
    wait_for(lambda: not listed(client)["freeze"]["available"], 15, "the hung server reported unavailable")
    assert "stopped answering" in mcp_state(client, "frozen")["last_error"]
    wait_for(lambda: mcp_state(client, "frozen")["state"] == "up", 30, "frozen restarted")
    assert instance(client, "frozen") != before
    # killed with its tree: gone (or a zombie its sandbox's init has not reaped yet: nothing runs there)
    wait_for(lambda: not any(_running(p) for p in old), 5, "the hung server's processes gone")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_an_agent_run_goes_on_past_a_crashed_mcp_call(tools):
    """The loop with scripted model replies and the real tool service: the crash comes back to the model as a
    tool error, the next call works, the run ends with an answer."""
    client, _, _ = tools
    wait_for(lambda: mcp_state(client, "crashy")["state"] == "up", 30, "crashy up")
    replies = [{"role": "assistant", "content": "", "tool_calls": [
                   {"id": "a", "type": "function", "function": {"name": "crash", "arguments": "{}"}}]},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "b", "type": "function",
                    "function": {"name": "robot_move_to", "arguments": '{"room": "garage"}'}}]},
               {"role": "assistant", "content": "The robot drove 38 m to the garage."}]
    no_questions = {"answer_language": False, "judge": False, "english_rules": "off"}  # the model is scripted here
    run = Run(parse_config({"agent": {"recall_k": 0, "policy": no_questions}}), "Drive to the garage.", "mcp-run", 4)
    while (req := run.pending) is not None:
        run.advance(_answer(req, client, replies))
    trace = run.trace
    crashed, moved = trace.steps[0].calls[0], trace.steps[1].calls[0]
    assert crashed.error.startswith("tool_failed: crashed:") and moved.output.startswith("Arrived in the garage")
    assert trace.stopped == "final_answer" and "38 m" in trace.answer


def _answer(req: ServiceCall, client: Client, replies: list[dict]):
    """The model and its budget scripted; tool requests to the real tool service."""
    if req.service == "tools":
        try:
            return client.request(req.type, req.body)
        except ServiceError as err:
            return err
    if req.type == "health":
        return {"n_ctx": 4096}
    if req.type == "tokenize":
        return {"tokens": req.body["text"].split()}
    if req.type == "optimizer.advice":
        return ServiceError("unavailable", "no optimizer")
    return chat_reply(replies.pop(0), prompt_tokens=100)
