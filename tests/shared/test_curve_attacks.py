"""Who may change the box (issue 16; issue 23, finding 7): a tool call over loopback tcp without a key,
an abstract ipc socket that any local account reaches, CURVE secrets written with the default umask."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zmq

from shared import security
from shared.client import Client, CurveKeys, ServiceError
from shared.config import parse_config
from shared.protocol import MESSAGES
from tests.conftest import REPO, ServiceProcess, free_port, make_config, wait_for, write_config

pytestmark = pytest.mark.security


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
