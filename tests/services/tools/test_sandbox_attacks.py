"""Hostile tools against the sandbox (issue 16; issue 23, finding 7): a ``setsid`` daemon that outlived
its kill, a tool reading the CURVE secrets in the data directory, one reaching the network, a shell value
that became an option, python tools that could not load, and file_reader (built in, unsandboxed)
reading what the sandbox hides."""

from __future__ import annotations

import socket
import uuid

import psutil
import pytest

from services.tools import builtins
from services.tools.jail import Jail
from shared import security
from shared.client import Client, ServiceError
from shared.config import parse_config
from shared.protocol import ErrorCode, ProtocolError
from tests.conftest import AS_ROOT, ServiceProcess, make_config, wait_for, write_config

pytestmark = pytest.mark.security


TOOLS = '''
import os, socket, subprocess, sys, time

def daemonize(marker):
    """Start a sleeper that escapes the process group (fork, setsid, fork), then hang."""
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            subprocess.Popen(["sleep", str(marker)])
            os._exit(0)
        os._exit(0)
    time.sleep(3600)

def read(path):
    with open(path, "rb") as f:
        return f.read().decode("utf-8", "replace")

def connect(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return "connected"
    except OSError as exc:
        return f"no network: {exc}"

def identity():
    return {"uid": os.getuid(), "gid": os.getgid()}

def fork_many(n):
    children = []
    try:
        for _ in range(n):
            children.append(subprocess.Popen(["sleep", "30"]))
    except OSError as exc:
        return f"stopped after {len(children)}: {exc}"
    finally:
        for c in children:
            c.kill()
    return f"started {len(children)}"
'''


def _python(name: str, target: str, props: dict | None = None, **extra) -> dict:
    return {"name": name, "kind": "python", "target": target, **extra,
            "parameters": {"type": "object", "properties": props or {}, "additionalProperties": False}}


def _shell(name: str, template: str, arg: str) -> dict:
    return {"name": name, "kind": "shell", "target": template,
            "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}


@pytest.fixture(scope="module")
def hostile_tools(tmp_path_factory):
    home = tmp_path_factory.mktemp("attacks")
    home.chmod(0o755)  # the tools' uid (nobody) reads the tool files; permissions still apply in the sandbox
    module = home / "hostile.py"
    module.write_text(TOOLS)
    mods = home / "mods"
    mods.mkdir()
    (mods / "robotmods.py").write_text("def wave(times):\n    return 'wave ' * times\n")
    data = home / "data"
    security.create_keys(data / "keys", ["robot"])
    (data / "feedback.db").write_text("SECRET ROW: the robot's feedback")
    config = parse_config({
        "agent": {"tools": [
            _python("escape", f"{module}:daemonize", {"marker": {"type": "integer"}}, limits={"timeout_s": 2}),
            _python("read", f"{module}:read", {"path": {"type": "string"}}),
            _python("offline", f"{module}:connect", {"port": {"type": "integer"}}),
            _python("online", f"{module}:connect", {"port": {"type": "integer"}}, network=True),
            _python("identity", f"{module}:identity"),
            _python("fork_many", f"{module}:fork_many", {"n": {"type": "integer"}}, limits={"max_processes": 8}),
            _python("relative", "hostile.py:identity"),  # relative to the service's working directory
            _python("wave", "robotmods:wave", {"times": {"type": "integer"}}, roots=[str(mods)]),
            _shell("cat", "cat {path}", "path"),
            _shell("ls", "ls {dir}", "dir"),
            _shell("ls_operands", "ls -- {dir}", "dir"),
        ]},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(data)},
        "metrics": {"base_port": 0},
    })
    svc = ServiceProcess("tools", write_config(home, config), config, cwd=home).start()
    client = Client(svc.endpoint, timeout_s=30)
    yield client, data, svc
    client.close()
    svc.stop()


def call(client: Client, tool: str, **args) -> str:
    return client.request("tool.call", {"tool": tool, "args": args})["output"]


def refused(client: Client, tool: str, **args) -> ServiceError:
    with pytest.raises(ServiceError) as info:
        call(client, tool, **args)
    return info.value


def test_the_sandbox_is_bubblewrap_here(hostile_tools):
    """CI installs bubblewrap; every tool test below must run in the sandbox, never silently bare."""
    client, _, _ = hostile_tools
    isolation = client.health()["tool_isolation"]
    assert isolation["isolation"] == "bubblewrap", isolation


def test_a_setsid_daemon_dies_with_its_tool_at_the_timeout(hostile_tools):
    client, _, _ = hostile_tools
    marker = 400000 + uuid.uuid4().int % 100000
    err = refused(client, "escape", marker=marker)
    assert err.message.startswith("timeout:")

    def leftovers():
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", str(marker)]]
    wait_for(lambda: not leftovers(), 5, f"every process of the tool gone (left: {leftovers()})")
    assert client.health()["ok"]


def test_a_tool_cannot_read_the_data_directory(hostile_tools):
    client, data, _ = hostile_tools
    secret = (data / "keys" / "server.key_secret").read_text()
    for tool in ("read", "cat"):
        for path in (data / "keys" / "server.key_secret", data / "feedback.db"):
            try:
                output = call(client, tool, path=str(path))
            except ServiceError as err:
                assert err.code == "tool_failed"
                continue
            assert "SECRET" not in output and secret not in output, (tool, path, output)


def test_a_tool_has_no_network_unless_it_declares_it(hostile_tools):
    client, _, _ = hostile_tools
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        assert call(client, "offline", port=port).startswith("no network")
        assert call(client, "online", port=port) == "connected"


def test_a_shell_value_cannot_become_an_option(hostile_tools):
    client, _, _ = hostile_tools
    err = refused(client, "ls", dir="--version")
    assert err.code == "tool_failed" and err.message.startswith("refused:") and "option" in err.message
    # After the template's --, the same value is an operand: ls looks for a file of that name.
    err = refused(client, "ls_operands", dir="--version")
    assert "cannot access '--version'" in err.message
    assert call(client, "ls_operands", dir="/") != ""


@pytest.mark.skipif(not AS_ROOT, reason="the uid drop applies when the service runs as root")
def test_a_tool_run_by_root_is_not_root_and_its_process_count_is_capped(hostile_tools):
    client, _, _ = hostile_tools
    import json
    assert json.loads(call(client, "identity")) == {"uid": 65534, "gid": 65534}
    assert call(client, "fork_many", n=50).startswith("stopped after")


def test_python_tools_load_from_a_relative_file_and_from_their_roots(hostile_tools):
    client, _, _ = hostile_tools
    assert "uid" in call(client, "relative")
    assert call(client, "wave", times=2) == "wave wave "


def test_tool_isolation_bubblewrap_refuses_to_start_without_it_what_would_run_in_it(tmp_path, monkeypatch):
    """Where bwrap cannot run (Docker Swarm gives a service no seccomp profile), a python or shell tool or a
    stdio MCP server is refused; built-in tools alone (they run in the service) start, saying why."""
    monkeypatch.setattr("shutil.which", lambda name: None)
    strict = {"tool_isolation": "bubblewrap", "file_roots": [str(tmp_path)]}
    for extra, named in (({"tools": [_python("probe", "tools_mod:f")]}, "tools probe"),
                         ({"tools": [_shell("say", "echo {text}", "text")]}, "tools say"),
                         ({"mcp_servers": [{"name": "notes", "command": ["notes-server"]}]}, "MCP servers notes")):
        config = parse_config({"agent": {**strict, **extra}, "runtime": {"data_dir": str(tmp_path)}})
        with pytest.raises(ValueError, match=f"{named} would run without it: bwrap is not installed"):
            Jail(config)
    builtins_only = Jail(parse_config({"agent": strict, "runtime": {"data_dir": str(tmp_path)}}))
    assert builtins_only.describe()["isolation"] == "rlimits"
    fallback = Jail(parse_config({"runtime": {"data_dir": str(tmp_path)}}))
    assert fallback.describe() == {"isolation": "rlimits", "tool_uid": None,
                                   "why": "bwrap is not installed (Debian package bubblewrap)"}


def test_file_reader_hides_what_the_sandbox_hides(tmp_path):
    """Finding 7: file_reader (built in, unsandboxed) read the CURVE secrets and databases under a broad root."""
    data = tmp_path / "data"
    security.create_keys(data / "keys", ["robot"])
    (data / "memory.db").write_text("SECRET ROW")
    (data / "docs").mkdir()
    (data / "docs" / "manual.txt").write_text("declared inside the data directory: readable")
    (tmp_path / "notes.txt").write_text("an ordinary file")
    wide = make_config(tmp_path)
    wide.agent.file_roots = [tmp_path]
    for private in (data / "keys" / "server.key_secret", data / "memory.db", data / "docs" / "manual.txt"):
        with pytest.raises(ProtocolError) as info:
            builtins.run_builtin("file_reader", {"path": str(private)}, wide)
        assert info.value.code == ErrorCode.TOOL_FAILED and "private" in info.value.message, private
    assert builtins.run_builtin("file_reader", {"path": "notes.txt"}, wide) == "an ordinary file"
    narrow = make_config(tmp_path)
    narrow.agent.file_roots = [data / "docs"]  # a root declared inside the data directory shows itself
    assert builtins.run_builtin("file_reader", {"path": "manual.txt"}, narrow).startswith("declared inside")
