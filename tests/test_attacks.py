"""Issues 16's and 23's findings, each as the attack that worked before and must fail now.

Hostile clients: a grammar that crashed llama.cpp, a shm handle forged from a
name listed in /dev/shm, a tool call over loopback tcp without a key, a batch
of telemetry with one bad sample. Hostile tools: a ``setsid`` daemon that
outlived its kill, a tool reading the CURVE secrets in the data directory, one
reaching the network, a shell value that became an option. Dying workers and
shutdowns: a dead worker that still read healthy, a SIGTERM during the first
prefill that dropped its reply. And the smaller ones: secrets written with the
default umask, knob ranges defined twice, python tools that could not load.

Issue 23 (the section at the end; its table in docs/security.md): files planted in
/dev/shm that stopped every start, a failed `up` that `down` could not stop, the
gateway's doors (keyless feedback, revoked keys, Host, uncounted routes), shm
segments of any size, drains that cut streams, the smaller ones, hostile chat
templates and objects on the wire. Finding 2 (tools under compose) is in
tests/test_compose_e2e.py.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import signal
import socket
import stat
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx2 as httpx
import msgpack
import psutil
import pytest
import structlog
import zmq
from fastapi import FastAPI
from fastapi.testclient import TestClient

from magnitude import launcher
from services.gateway import errors
from services.gateway.keys import create_key, read_local_key
from services.gateway.middleware import OPEN_PATH_SLOTS
from services.inference import session_store
from services.inference.chat_template import ChatTemplate, TemplateError
from services.inference.session_store import SessionStore
from services.tools import builtins
from services.tools.jail import Jail
from services.watchdog.supervisor import Supervisor
from shared import process, security, shm
from shared.client import Client, CurveKeys, ServiceError
from shared.config import EngineConfig, TunableSettings, parse_config
from shared.health import probe
from shared.logs import configure_logging
from shared.protocol import (MESSAGES, PROTOCOL_VERSION, ErrorCode, ProtocolError, Request, decode_reply, decode_request,
                             encode_request)
from shared.service import Job, Service
from tests.conftest import (MODEL_PATH, REPO, REPORT, ServiceProcess, gaps_while, make_config, require_model,
                            running_inference, wait_for, write_config)
from tests.test_curve import free_port

AS_ROOT = os.geteuid() == 0

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


# --- hostile tools ---------------------------------------------------------------------------
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


# --- hostile clients -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tcp_tools(tmp_path_factory):
    """A tools service on loopback tcp without CURVE: reachable by every local user."""
    home = tmp_path_factory.mktemp("tcp")
    config = parse_config({"runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data"),
                                       "endpoints": {"tools": f"tcp://127.0.0.1:{free_port()}"}},
                           "metrics": {"base_port": 0}})
    svc = ServiceProcess("tools", write_config(home, config), config).start()
    yield svc
    svc.stop()


def test_an_unauthenticated_tool_call_over_loopback_tcp_is_refused(tcp_tools):
    with Client(tcp_tools.endpoint, timeout_s=10) as client:
        assert client.health()["ok"] and client.request("tool.list")["tools"]  # reading is fine
        with pytest.raises(ServiceError) as info:
            client.request("tool.call", {"tool": "calculator", "args": {"expression": "1+1"}})
        assert info.value.code == "unauthorized" and "CURVE" in info.value.message


def test_every_message_that_changes_the_box_needs_authentication():
    privileged = {name for name, spec in MESSAGES.items() if spec.privileged}
    assert {"engine.configure", "model.load", "model.unload", "model.switch", "strategy.set", "tool.call",
            "memory.upsert", "memory.upsert_many", "memory.delete", "feedback", "telemetry"} <= privileged
    assert not privileged & {"health", "metrics", "generate", "tokenize", "tool.list", "memory.query"}
    assert not security.peers_authenticated("tcp://127.0.0.1:5555", curve=False)
    assert security.peers_authenticated("tcp://127.0.0.1:5555", curve=True)
    assert security.peers_authenticated("ipc:///run/x.sock", curve=False)


def test_a_curve_client_may_call_tools_over_tcp(tmp_path):
    keys = tmp_path / "keys"
    security.create_keys(keys, ["robot"])
    config = parse_config({"runtime": {"runtime_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"),
                                       "curve": True, "keys_dir": str(keys),
                                       "endpoints": {"tools": f"tcp://127.0.0.1:{free_port()}"}},
                           "metrics": {"base_port": 0}})
    svc = ServiceProcess("tools", write_config(tmp_path, config), config, curve=CurveKeys(keys, "robot")).start()
    try:
        with Client(svc.endpoint, timeout_s=10, curve=CurveKeys(keys, "robot")) as client:
            reply = client.request("tool.call", {"tool": "calculator", "args": {"expression": "6*7"}})
            assert reply["output"] == "42"
    finally:
        svc.stop()


@pytest.mark.model
def test_a_grammar_bomb_is_a_typed_error_and_inference_stays_up(inference_service):
    def bomb(levels: int) -> str:
        return "root ::= " + "(" * levels + '"a"' + ")" * levels

    with Client(inference_service.endpoint, timeout_s=60) as client:
        pid = client.health()["pid"]
        # The 200 KB bomb, and one within the size limit that llama.cpp's parser still cannot survive.
        for grammar, why in ((bomb(100_000), "bytes"), (bomb(30_000), "nested 30000 deep")):
            with pytest.raises(ServiceError) as info:
                client.generate("Say a", max_tokens=2, grammar=grammar)
            assert info.value.code == "bad_request" and why in info.value.message, info.value
        assert client.generate("Say a", max_tokens=2, grammar='root ::= "a"').text == "a"
        health = client.health()
        assert health["ok"] and health["pid"] == pid


@pytest.mark.model
def test_a_forged_shm_handle_is_refused(inference_service):
    owner_session, intruder = f"owner-{uuid.uuid4().hex}", f"intruder-{uuid.uuid4().hex}"
    secret = b"session A's plan: the spare key is under the blue bowl"
    handle = shm.put_bytes(secret, session=owner_session)
    with Client(inference_service.endpoint, timeout_s=60) as client:
        # What an intruder can learn from /dev/shm is the name; it forges the rest.
        assert handle["name"] in shm.list_segments()
        forgeries = [{"name": handle["name"], "size": len(secret), "kind": "bytes", "session": intruder},
                     {"name": handle["name"], "size": len(secret), "kind": "bytes", "key": "0" * 32},
                     {**handle, "session": intruder}]  # even the real key, claimed by another session
        for forged in forgeries:
            with pytest.raises(ServiceError) as info:
                client.request("generate", {"prompt_shm": forged, "max_tokens": 1}, session=intruder)
            assert info.value.code in ("not_found", "bad_request"), forged
            assert handle["name"] in shm.list_segments()  # refused, and left for its owner
    assert shm.take_bytes(handle, session=owner_session) == secret


def test_a_bad_telemetry_sample_is_rejected_alone(tmp_path):
    config = make_config(tmp_path)
    svc = ServiceProcess("optimizer", write_config(tmp_path, config), config).start()
    try:
        good = {"type": "tool.call", "latency_s": 0.02, "queue_wait_s": 0.0, "ok": True, "code": None}
        with Client(svc.endpoint, timeout_s=10) as client:
            reply = client.request("telemetry", {
                "service": "tools", "pid": 4242,
                "samples": [good, {**good, "latency_s": "fast"}, "not a map", {**good, "latency_s": float("inf")}],
                "system": {"rss_mb": 12.5, "cpu_percent": 1.0, "queue_depth": 0, "telemetry_dropped": 0}})
            assert reply["accepted"] == 2 and reply["rejected"] == 3, reply
            assert any("latency_s" in e for e in reply["errors"])
            # The good ones reached the optimizer, the system figures of the same batch included.
            wait_for(lambda: client.request("optimizer.status")["processes"].get("tools", {}).get("pid") == 4242,
                     5, "the batch's good samples ingested")
            for i in range(3):  # names a sender makes up never become keys of the optimizer's dicts
                with pytest.raises(ServiceError) as info:
                    client.request("telemetry", {"service": f"made-up-{i}", "samples": [good]})
                assert info.value.code == "bad_request"
            assert set(client.request("optimizer.status")["processes"]) == {"tools"}
            assert client.health()["ok"]
    finally:
        svc.stop()


# --- dying workers, shutdowns ----------------------------------------------------------------
class _FragileBackend:
    """The watchdog's view of one stand-in tools process (tests.fragile_service); the others are absent."""

    kind = "test"

    def __init__(self, svc: ServiceProcess):
        self.svc, self.restarted = svc, []

    def pid(self, name: str) -> int | None:
        return self.svc.proc.pid if name == "tools" and self.svc.proc.poll() is None else None

    def memory_mb(self, name: str) -> float | None:
        return None

    def start(self, name: str) -> None:
        pass  # the other services are not part of this test

    def restart(self, name: str, hard: bool) -> None:
        self.restarted.append((name, hard))
        self.svc.proc.kill()
        self.svc.proc.wait()
        self.svc.start()

    def set_nice(self, name: str, nice: int) -> None:
        pass

    def pin(self, name: str, cpus: set[int]) -> None:
        pass


def test_a_killed_worker_reads_unhealthy_and_the_watchdog_restarts_the_service(tmp_path):
    config = make_config(tmp_path)
    config.watchdog.hung_checks = 2
    svc = ServiceProcess("tools", write_config(tmp_path, config), config, module="tests.fragile_service").start()
    backend = _FragileBackend(svc)
    supervisor = Supervisor(config, backend, configure_logging("watchdog", "warning"))
    try:
        supervisor.tick()
        assert supervisor.states["tools"].state == "healthy"
        first_pid = svc.proc.pid
        with Client(svc.endpoint, timeout_s=1) as client:
            with pytest.raises(ServiceError):
                client.request("tool.list")  # kills the only worker; its request is lost with it
            wait_for(lambda: not client.health()["ok"], 5, "health to turn unhealthy")
        for _ in range(config.watchdog.hung_checks):
            supervisor.tick()
        assert supervisor.states["tools"].last_reason == "hung" and backend.restarted == [("tools", True)]
        assert svc.proc.pid != first_pid
        with Client(svc.endpoint, timeout_s=5) as client:
            assert client.health()["ok"]
    finally:
        svc.stop()


@pytest.mark.model
def test_sigterm_during_the_first_prefill_still_answers(tmp_path):
    require_model()
    config = make_config(tmp_path, n_ctx=4096, max_batch_size=2048, prefill_chunk_size=2048)
    svc = ServiceProcess("inference", write_config(tmp_path, config), config).start()
    try:
        prompt = "The robot checked the hallway, the kitchen and the garage. " * 220  # ~2,800 tokens
        with Client(svc.endpoint, timeout_s=120) as client:
            client.send_raw(encode_request("generate", {"prompt": prompt, "max_tokens": 4}, request_id="first"))
            # Health on the same socket is read after the generate: queue_depth 0 means the worker took it.
            while True:
                client.send_raw(encode_request("health", request_id="probe"))
                reply = client.recv_reply()
                if reply.id == "probe" and reply.body["queue_depth"] == 0:
                    break
            svc.proc.send_signal(signal.SIGTERM)
            reply = client.recv_reply("first")
            assert reply.kind == "ok" and reply.body["stats"]["completion_tokens"] >= 1
        assert svc.proc.wait(30) == 0
    finally:
        svc.stop()


# --- the smaller ones ------------------------------------------------------------------------
def test_curve_secrets_are_private_from_the_first_byte_and_checked_on_load(tmp_path, monkeypatch):
    keys = tmp_path / "keys"
    keys.mkdir(mode=0o755)
    old_umask = os.umask(0)  # the most permissive default a process can have
    try:
        # No chmod may rescue a secret written world-readable: a crash in between would leave it so.
        monkeypatch.setattr(Path, "chmod", lambda self, mode: None)
        monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
        written = security.create_keys(keys, ["robot"])
    finally:
        os.umask(old_umask)
        monkeypatch.undo()
    for path in written:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert not mode & (0o077 if path.name.endswith("key_secret") else 0o022), (path, oct(mode))
    security.create_keys(keys, [])  # an existing directory is tightened
    assert stat.S_IMODE(keys.stat().st_mode) == 0o700
    (keys / "server.key_secret").chmod(0o644)
    with pytest.raises(security.SecurityError, match="chmod 600"):
        security.CurveServer(zmq.Context.instance(), keys)


def test_knob_ranges_are_defined_once():
    """engine.configure, strategy files and optimizer overrides accept a knob value exactly when the engine does
    (they disagreed: prefill_chunk_size >= 1 vs >= 16, max_batch_size <= 8192 vs <= 4096)."""
    def accepts(model, **values) -> bool:
        try:
            model(**values)
            return True
        except ValueError:
            return False

    for name in TunableSettings.model_fields:
        bounds = [getattr(m, a) for m in EngineConfig.model_fields[name].metadata for a in ("ge", "le")
                  if getattr(m, a, None) is not None]
        for value in {v for b in bounds for v in (b - 1, b, b + 1)}:
            room = {"max_batch_size": 8192} if name == "prefill_chunk_size" else {}  # its cross-field rule
            assert accepts(TunableSettings, **{name: value}) == accepts(EngineConfig, **room, **{name: value}), \
                (name, value)


def test_tool_isolation_bubblewrap_refuses_to_start_without_it(tmp_path, monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    config = parse_config({"agent": {"tool_isolation": "bubblewrap"}, "runtime": {"data_dir": str(tmp_path)}})
    with pytest.raises(ValueError, match="bwrap is not installed"):
        Jail(config)
    fallback = Jail(parse_config({"runtime": {"data_dir": str(tmp_path)}}))
    assert fallback.describe() == {"isolation": "rlimits", "tool_uid": None,
                                   "why": "bwrap is not installed (Debian package bubblewrap)"}


# --- issue 23: hardening, second round ---------------------------------------------------------
def _dead_pid() -> int:
    """A pid that was just used and has exited (reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_planted_shm_files_cannot_stop_a_service_from_starting(tmp_path):
    """Finding 3: any account may create files in /dev/shm; on main each of these made every service exit 1."""
    dead = _dead_pid()
    planted = {"overflow": "mag_99999999999_0", "negative": "mag_-1_0123456789abcdef",
               "another uid's orphan": f"mag_{dead}_{uuid.uuid4().hex[:16]}"}
    orphan = f"mag_{dead}_{uuid.uuid4().hex[:16]}"  # ours, of a dead process: the sweep's real job
    for name in (*planted.values(), orphan):
        (Path("/dev/shm") / name).write_bytes(b"x")
    if AS_ROOT:
        os.chown(Path("/dev/shm") / planted["another uid's orphan"], 65534, 65534)
    try:
        config = make_config(tmp_path)
        svc = ServiceProcess("tools", write_config(tmp_path, config), config).start()
        svc.stop()
        assert svc.proc.returncode == 0
        left = set(shm.list_segments())
        assert set(planted.values()) <= left, "files not in our format, or not ours, are not the sweep's to remove"
        assert orphan not in left
    finally:
        for name in planted.values():
            shm.unlink(name)


def test_down_stops_a_stack_process_that_no_pid_file_names(tmp_path):
    """Finding 3: a failed `up` left an inference process without a pid file (its starter, the watchdog, died
    between starting it and writing the file), and `down` said "not running"."""
    config = make_config(tmp_path)
    path = write_config(tmp_path, config)
    proc = process.spawn(config, "tools", str(path))
    try:
        wait_for(lambda: probe(config, "tools", timeout_s=1).healthy, 60, "tools up")
        process.pid_file(config, "tools").unlink()
        outcome = launcher.down(config)
        assert proc.poll() is not None, outcome
        assert any("services.tools" in what and how.startswith("stopped") for what, how in outcome.items()), outcome
        assert process.stack_processes(config) == {}
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_an_oversized_shm_segment_is_refused_before_it_is_read():
    """Finding 5: the taker's cap is checked from the header and the segment's size, a typed error."""
    handle = shm.put_bytes(b"a" * (2 << 20))
    with pytest.raises(ProtocolError) as info:
        shm.take_bytes(handle, max_bytes=1 << 20)
    assert info.value.code == ErrorCode.TOO_LARGE and "at most 1048576" in info.value.message
    assert handle["name"] not in shm.list_segments()  # a valid handle given up: the segment goes
    small = shm.put_bytes(b"b" * 1000)
    assert shm.take_bytes(small, max_bytes=1000) == b"b" * 1000


@pytest.mark.model
def test_an_oversized_prompt_shm_fails_only_its_request(inference_service):
    """Finding 5: on main a prompt_shm of any size was read and tokenized before the context check."""
    handle = shm.put_bytes(b"word " * ((16 << 20) // 5), session="big")
    with Client(inference_service.endpoint, timeout_s=60) as client:
        started = time.monotonic()
        with pytest.raises(ServiceError) as info:
            client.request("generate", {"prompt_shm": handle, "max_tokens": 1}, session="big")
        assert info.value.code == "too_large", info.value
        assert time.monotonic() - started < 5
        assert handle["name"] not in shm.list_segments()
        assert client.generate("The robot", max_tokens=2).stats.completion_tokens >= 1
        assert client.health()["ok"]


def _gateway(home: Path, keys_file: Path | None = None, **gateway) -> tuple[ServiceProcess, str]:
    """A gateway on loopback (and an optimizer behind it), as `magnitude up` starts it; its URL."""
    config = make_config(home)
    config = parse_config({**config.model_dump(mode="json"), "gateway": {
        "port": 0, **({"api_keys_file": str(keys_file)} if keys_file else {}), **gateway}})
    svc = ServiceProcess("gateway", write_config(home, config), config).start()
    with Client(svc.endpoint, timeout_s=5) as c:
        return svc, c.health()["url"]


def _key(svc: ServiceProcess) -> dict:
    """The headers of the key a gateway's first start made (keys_dir/local.key)."""
    return {"Authorization": f"Bearer {read_local_key(svc.config)}"}


def test_keyless_feedback_is_bounded_in_rate_size_and_rows(tmp_path):
    """Finding 4a: without keys the gateway relayed any amount of feedback, the mesh's privileged message."""
    config = make_config(tmp_path)
    optimizer = ServiceProcess("optimizer", write_config(tmp_path, config), config).start()
    gateway = None
    try:
        gateway, url = _gateway(tmp_path, allow_keyless_loopback=True)  # feedback_per_minute: 30 by default
        answers = [httpx.post(f"{url}/v1/feedback", json={"session_id": f"run-{i}", "success": True}).status_code
                   for i in range(32)]
        assert answers == [200] * 30 + [429] * 2, answers
        big = httpx.post(f"{url}/v1/feedback", json={"session_id": "run", "success": False,
                                                     "details": {"log": "x" * 20000}})
        assert big.status_code == 400 and "details" in big.json()["error"]["message"]
    finally:
        if gateway is not None:
            gateway.stop()
        optimizer.stop()
    config = parse_config({**config.model_dump(mode="json"), "optimizer": {"max_feedback_rows": 100}})
    optimizer = ServiceProcess("optimizer", write_config(tmp_path, config), config).start()
    try:
        with Client(optimizer.endpoint, timeout_s=10) as client:  # rows are bounded whoever sends them
            for i in range(120):
                client.request("feedback", {"session_id": f"run-{i}", "success": i % 2 == 0})
            assert client.request("feedback.stats")["total"] == 100
    finally:
        optimizer.stop()


def test_revoking_the_last_api_key_does_not_turn_authentication_off(tmp_path):
    """Finding 4b: on main, revoking the only key made the gateway answer 200 without a key."""
    keys_file = tmp_path / "api_keys"
    key = create_key(keys_file, "robot")
    gateway, url = _gateway(tmp_path, keys_file)
    try:
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        config = write_config(tmp_path, gateway.config)
        subprocess.run([sys.executable, "scripts/keys", "--config", str(config), "revoke-api-key", "robot"],
                       cwd=REPO, check=True, capture_output=True)
        for headers in ({}, {"Authorization": f"Bearer {key}"}):
            answer = httpx.get(f"{url}/metrics", headers=headers)
            assert answer.status_code == 401, answer.text
        assert "revoked" in answer.json()["error"]["message"]
    finally:
        gateway.stop()


def test_a_request_naming_another_host_is_refused(tmp_path):
    """Finding 4c: a web page that re-points its name at 127.0.0.1 (DNS rebinding) reached the gateway."""
    gateway, url = _gateway(tmp_path, allowed_hosts=["robot.local"])
    port = urlsplit(url).port
    try:
        for host in (f"evil.example:{port}", "evil.example", f"0.0.0.0:{port}", "", "[::1"):
            answer = httpx.get(f"{url}/metrics", headers={"Host": host, **_key(gateway)})
            assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_host", (host, answer)
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "robot.local"):
            assert httpx.get(f"{url}/metrics", headers={"Host": host, **_key(gateway)}).status_code == 200, host
    finally:
        gateway.stop()


def test_every_route_counts_against_a_concurrency_limit(tmp_path):
    """Finding 4d: /health (and /metrics, /openapi.json) bypassed gateway.max_concurrent. Now every API route
    counts against it, and the open paths (/health, /openapi.json) against a pool of their own: a full API pool
    never starves the health checks (issue 34, finding 1), and they are bounded too."""
    gateway, url = _gateway(tmp_path, max_concurrent=1)
    port = urlsplit(url).port
    try:
        with socket.create_connection(("127.0.0.1", port)) as slow:  # a request in flight: its body comes slowly
            slow.sendall(b"POST /v1/feedback HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         + f"Authorization: {_key(gateway)['Authorization']}\r\n".encode()
                         + b"Content-Length: 100\r\n\r\n{")
            wait_for(lambda: httpx.get(f"{url}/metrics", headers=_key(gateway)).status_code == 429, 5, "the slot taken")
            assert httpx.get(f"{url}/v1/models", headers=_key(gateway)).status_code == 429
            for path in ("/health", "/openapi.json"):
                assert httpx.get(f"{url}{path}").status_code != 429, path
            open_slots = [socket.create_connection(("127.0.0.1", port)) for _ in range(OPEN_PATH_SLOTS)]
            try:  # the open pool full of stalled requests: one more is refused, the API's slot unaffected
                for sock in open_slots:
                    sock.sendall(b"POST /health HTTP/1.1\r\nHost: localhost\r\nContent-Length: 100\r\n\r\n{")
                wait_for(lambda: httpx.get(f"{url}/health").status_code == 429, 5, "the open pool full")
            finally:
                for sock in open_slots:
                    sock.close()
        wait_for(lambda: httpx.get(f"{url}/metrics", headers=_key(gateway)).status_code == 200, 5, "the slot back")
        wait_for(lambda: httpx.get(f"{url}/health").status_code != 429, 5, "the open pool back")
    finally:
        gateway.stop()


@pytest.mark.model
def test_sigterm_lets_a_gateway_stream_finish(tmp_path):
    """Finding 6: on main the gateway's streams were cut about 5 s after SIGTERM (no in-flight accounting)."""
    with running_inference(tmp_path) as _:
        gateway, url = _gateway(tmp_path)
        try:
            body = {"model": "default", "prompt": "Once upon a time", "max_tokens": 600, "temperature": 0,
                    "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=_key(gateway),
                              timeout=120) as stream:
                lines = stream.iter_lines()
                assert next(line for line in lines if line.startswith("data:"))
                gateway.proc.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                events = [line.removeprefix("data: ") for line in lines if line.startswith("data:")]
            assert events[-1] == "[DONE]", events[-3:]
            finish = json.loads(events[-2])["choices"][0]["finish_reason"]
            assert finish in ("length", "stop")
            drained = time.monotonic() - signalled
            assert gateway.proc.wait(30) == 0
            REPORT.append(f"gateway drain: a stream ran {drained:.1f} s after SIGTERM and ended with [DONE]")
            assert drained > 5 or finish == "stop"
        finally:
            gateway.stop()


def test_compose_grace_covers_the_drain():
    """Finding 6: compose's stop_grace_period (30 s) was shorter than the services' 60 s drain, so inference
    could be killed before its sessions were saved."""
    import yaml
    need = parse_config({}).runtime.stop_timeout_s()
    for name, svc in yaml.safe_load((REPO / "compose.yaml").read_text())["services"].items():
        if svc["command"][:2] == ["python", "-m"]:
            grace = svc["stop_grace_period"]
            assert grace.endswith("s") and float(grace[:-1]) >= need, (name, grace, need)


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


def test_a_session_file_with_a_field_of_the_wrong_type_is_rejected(tmp_path):
    """Finding 7: a header field that was not an integer raised TypeError, and the session failed on every
    request."""
    fingerprint = {"model": {"path": "/m.gguf"}, "n_ctx": 2048}
    store = SessionStore(tmp_path, fingerprint, 1 << 20)
    for field, value in (("n_tokens", "2"), ("state_bytes", 2.5), ("crc32", None), ("n_tokens", -1)):
        store.save("s", [1, 2], b"state")
        path = store.path("s")
        data = path.read_bytes()
        start = len(session_store.MAGIC) + 4
        (n,) = struct.unpack_from("<I", data, len(session_store.MAGIC))
        header = json.loads(data[start:start + n])
        forged = json.dumps({**header, field: value}).encode()
        path.write_bytes(session_store.MAGIC + struct.pack("<I", len(forged)) + forged + data[start + n:])
        assert store.load("s") is None and not path.exists(), (field, value)


def test_a_dead_writers_session_tmp_file_is_evicted(tmp_path):
    """Finding 7: the .tmp file of a write that died was never deleted (nor counted in the budget)."""
    stale = tmp_path / f"{'0' * 40}.tmp{_dead_pid()}"
    stale.write_bytes(b"x" * 4096)
    live = tmp_path / f"{'1' * 40}.tmp{os.getpid()}"  # a writer that is still writing
    live.write_bytes(b"y")
    store = SessionStore(tmp_path, {"model": None}, 1 << 20)
    assert not stale.exists() and live.exists()
    stale.write_bytes(b"x" * 4096)  # and at each eviction, not only when the store opens
    assert store.save("s", [1], b"state")
    assert not stale.exists() and live.exists()


def test_an_abstract_ipc_endpoint_is_not_authenticated(tmp_path):
    """Finding 7: ipc://@name (a Linux abstract socket, which any local account can reach) passed the endpoint
    check and counted as authenticated, so it would serve tool.call to anyone."""
    abstract = f"ipc://@magnitude-test-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ValueError, match="abstract"):
        parse_config({"runtime": {"endpoints": {"tools": abstract}}})
    assert not security.peers_authenticated(abstract, curve=False)
    path = write_config(tmp_path, make_config(tmp_path))
    # --endpoint, which no config validation sees, can still ask for one
    proc = subprocess.Popen([sys.executable, "-m", "services.tools", "--config", str(path), "--endpoint", abstract],
                            env=dict(os.environ, PYTHONPATH=str(REPO)),
                            stderr=subprocess.DEVNULL)
    try:
        with Client(abstract, timeout_s=10) as client:
            wait_for(lambda: client.health()["ok"], 30, "tools on the abstract socket")
            with pytest.raises(ServiceError) as info:
                client.request("tool.call", {"tool": "calculator", "args": {"expression": "1+1"}})
            assert info.value.code == "unauthorized"
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_internal_error_reply_carries_no_exception_text(tmp_path):
    """Finding 7: 500s (the gateway's) and internal errors (every service's) carried the exception's text,
    file paths included."""
    secret_path = str(tmp_path / "data" / "keys" / "server.key_secret")

    def bug():
        raise PermissionError(13, "Permission denied", secret_path)

    app = FastAPI()
    errors.install(app, 1, structlog.get_logger())
    app.get("/bug")(bug)
    answer = TestClient(app, raise_server_exceptions=False).get("/bug")
    message = answer.json()["error"]["message"]
    assert answer.status_code == 500 and secret_path not in message and "PermissionError" in message, message

    sent = []

    class Out:
        def send_multipart(self, frames):
            sent.append(frames[-1])

    service = Service(make_config(tmp_path), endpoint=f"ipc://{tmp_path}/unused.sock")
    try:
        bug()
    except PermissionError as exc:
        service.answer(Job([b"peer"], Request("r1", "tool.list", None, {}), time.monotonic()), Out()).fail(exc)
    reply = decode_reply(sent[0])
    assert reply.error_code == "internal" and secret_path not in reply.error_message, reply
    assert "ref" in reply.error_message


def test_no_pickle_and_no_objects_come_off_the_wire():
    """Finding 8: the SGLang ZeroMQ CVEs of 2026 were pickle. No module of ours pickles, and a frame holds plain
    msgpack values only: extension types (how objects would travel) are a bad_frame."""
    forbidden_modules = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}
    forbidden_calls = {"recv_pyobj", "send_pyobj", "recv_serialized", "send_serialized", "loads_pyobj"}
    for path in sorted(REPO.glob("*/**/*.py")):
        if path.parts[len(REPO.parts)] not in ("shared", "services", "magnitude", "scripts"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) else [])
                assert not {n.split(".")[0] for n in names if n} & forbidden_modules, (path, names)
            if isinstance(node, ast.Attribute):
                assert node.attr not in forbidden_calls, (path, node.attr)
            if isinstance(node, ast.keyword) and node.arg == "allow_pickle":
                assert isinstance(node.value, ast.Constant) and node.value.value is False, path
    for value in (msgpack.ExtType(42, pickle.dumps(print)), msgpack.ExtType(1, b"")):
        frame = msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "type": "health", "body": {"payload": value}})
        with pytest.raises(ProtocolError) as info:
            decode_request(frame, max_frame_bytes=1 << 20, handled={"health"})
        assert info.value.code == ErrorCode.BAD_FRAME
    stamp = msgpack.packb({"v": PROTOCOL_VERSION, "id": "x", "type": "health", "body": {"at": msgpack.Timestamp(1, 5)}})
    assert decode_request(stamp, max_frame_bytes=1 << 20, handled={"health"}).body["at"] == 1_000_000_005


@pytest.mark.parametrize("template, refused", [
    # CVE-2024-34359 (llama-cpp-python): a GGUF's chat template reaching os through the subclasses of object.
    pytest.param("{% for x in ().__class__.__base__.__subclasses__() %}{% if 'warning' in x.__name__ %}"
                 "{{ x()._module.__builtins__['__import__']('os').system('touch PWNED') }}{% endif %}{% endfor %}",
                 "unsafe", id="cve-2024-34359"),
    pytest.param("{{ cycler.__init__.__globals__.os.system('touch PWNED') }}", "unsafe", id="globals"),
    # Sized so that main, which computed them (the constant ones while compiling), fails fast: a template can
    # ask for 9 ** 99999999, 'a' * 10**10 or range(100000) inside range(100000) as easily.
    pytest.param("{{ (9 ** 1000000) | string | length }}", "4096 bits", id="power"),
    pytest.param("{{ ('a' * 200000000) | length }}", "sequence over", id="repeat"),
    pytest.param("{% for i in range(100000) %}{% for j in range(20) %}{% endfor %}{% endfor %}", "ranges go over",
                 id="nested-ranges"),
])
def test_a_hostile_chat_template_renders_nothing_dangerous(template, refused, tmp_path, monkeypatch):
    """Finding 8: a GGUF's tokenizer.chat_template is code from whoever made the file."""
    monkeypatch.chdir(tmp_path)
    started = time.monotonic()
    with pytest.raises(TemplateError, match=refused):
        ChatTemplate(template).render_text([{"role": "user", "content": "hi"}])
    assert time.monotonic() - started < 2 and not (tmp_path / "PWNED").exists()
    assert ChatTemplate("{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ 123456 * 654321 }}").render_text([]) == \
        "1024 ababab 80779853376"


# --- issue 23, finding 1: one tenant's prompt stays its own -------------------------------------------
def test_cached_tokens_tell_no_tenant_about_another_tenants_prompt(tmp_path):
    """Alice's prompt holds a secret. Mallory, with her own key and a fresh session id per guess, sends the
    same prefix followed by a guess at the next digit, max_tokens 1, and reads cached_tokens: before, the
    right digit scored one token more than every wrong one. Now KV is shared only within an owner, so every
    guess scores the same (and the owner herself still reuses her prefix)."""
    from openai import OpenAI
    from services.gateway.keys import create_key
    config = make_config(tmp_path, session_slots=4)
    keys_file = tmp_path / "api_keys"
    keys = {name: create_key(keys_file, name) for name in ("alice", "mallory")}
    config = parse_config({**config.model_dump(mode="json"),
                           "gateway": {**config.gateway.model_dump(mode="json"), "api_keys_file": str(keys_file)}})
    path = write_config(tmp_path, config)
    services = [ServiceProcess(name, path, config).start() for name in ("inference", "gateway")]
    try:
        with Client(services[1].endpoint, timeout_s=5) as c:
            url = c.health()["url"] + "/v1"
        sdk = {name: OpenAI(base_url=url, api_key=key, max_retries=0) for name, key in keys.items()}
        note = "Household notes. The plumber comes on Friday. The code of the garden safe is 4"
        sdk["alice"].completions.create(model="default", prompt=note + "817.", max_tokens=1, temperature=0,
                                        extra_headers={"X-Session-Id": "alice-notes"})

        def probe(guess: str) -> int:
            reply = sdk["mallory"].completions.create(model="default", prompt=note + guess, max_tokens=1,
                                                      temperature=0,
                                                      extra_headers={"X-Session-Id": uuid.uuid4().hex})
            return reply.usage.prompt_tokens_details.cached_tokens

        probe("x")  # her own KV of the prefix, so every guess below starts equal
        scores = {digit: probe(digit) for digit in "0123456789"}
        assert len(set(scores.values())) == 1, scores
        mine = sdk["alice"].completions.create(model="default", prompt=note + "817. And", max_tokens=1,
                                               temperature=0, extra_headers={"X-Session-Id": "alice-notes"})
        assert mine.usage.prompt_tokens_details.cached_tokens > scores["8"]
    finally:
        for svc in reversed(services):
            svc.stop()


# --- issue 23, finding 5: models and grammars from requests --------------------------------------------
def test_a_corrupt_model_file_fails_its_request_and_loads_are_bounded(tmp_path):
    """A request naming a corrupt GGUF killed the scheduler's worker on main; it now fails that request alone.
    And a caller alternating between models that are not resident cannot make the box load and evict them in
    a loop: requests bring in one model per engine.model_load_interval_s."""
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    with running_inference(tmp_path, max_models=1, models={"broken": str(corrupt), "other": str(MODEL_PATH)}) as svc:
        with Client(svc.endpoint, timeout_s=60) as client:
            pid = client.health()["pid"]
            with pytest.raises(ServiceError) as err:
                client.generate("Hello", max_tokens=2, model="broken")
            assert err.value.code == "bad_request" and "cannot be loaded" in err.value.message
            assert client.generate("Hello", max_tokens=2, model="other").stats.model == "other"
            with pytest.raises(ServiceError) as err:  # back to the default at once: that would be a second load
                client.generate("Hello", max_tokens=2)
            assert err.value.code == "busy" and "model_load_interval_s" in err.value.message
            health = client.health()
            assert health["ok"] and health["pid"] == pid and health["model_loads"] == 2


def test_a_deep_grammar_is_flattened_off_the_decode_thread(inference_service):
    """A 128 KB grammar nested 999 deep cost 1.5 s of flattening on the decode thread: another stream stopped
    for that long. It is prepared on a preparing worker now; the stream keeps its pace."""
    grammar = "root ::= " + "(" * 999 + '"a"' + ")" * 999 + " " + " ".join(["[a-z]"] * 20000)
    grammar = grammar[:127 * 1024]
    done = {}
    with Client(inference_service.endpoint, timeout_s=120) as steady, \
            Client(inference_service.endpoint, timeout_s=120) as hostile:
        stream = steady.generate_stream("Count from one to one hundred: one, two,", max_tokens=120, temperature=0,
                                        cache_prompt=False)
        gaps = gaps_while(stream, 5, lambda: done.update(
            reply=_outcome(lambda: hostile.generate("a", max_tokens=2, grammar=grammar))))
    assert "reply" in done and gaps and max(gaps) < 0.5, (done, max(gaps, default=None))


def _outcome(call):
    """The call's result, or the typed error it answered (a refusal is a bounded answer too)."""
    try:
        return call()
    except ServiceError as err:
        return err
