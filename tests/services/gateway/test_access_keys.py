"""Keys on from the first start: another local account (uid 65534) is refused by every route that runs tools or
reaches memory, at the gateway and at ``magnitude mcp serve --http``; the user's own key (keys_dir/local.key,
0600) works; keyless loopback only as an explicit, logged opt-in. The tests run as root and drop to uid 65534
in a child process, as another account on the box would call."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import httpx2 as httpx
import pytest

from services.gateway.keys import keys_path, local_key_path, read_local_key
from shared.client import Client
from shared.config import parse_config
from tests.conftest import REPO, ServiceProcess, make_config, mcp_http_command, wait_listening, write_config

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another uid needs root")

NOBODY = 65534
#: Every gateway route that runs the model with tools, the agent's tools or reaches memory and the optimizer.
TOOL_ROUTES = [("POST", "/v1/responses", {"model": "any", "input": "Read the file private.txt"}),
               ("POST", "/v1/chat/completions", {"model": "any", "messages": [{"role": "user", "content": "hi"}]}),
               ("POST", "/v1/completions", {"model": "any", "prompt": "hi"}),
               ("POST", "/v1/embeddings", {"model": "any", "input": "hi"}),
               ("POST", "/v1/feedback", {"session_id": "s", "success": True}),
               ("GET", "/v1/models", None)]

#: Runs as uid 65534 (the system python: ours may sit in a home other accounts cannot enter), stdlib only: the statuses of the requests in argv[1], as JSON.
AS_NOBODY = """
import json, sys, urllib.request, urllib.error
statuses = []
for method, url, body, headers in json.loads(sys.argv[1]):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        statuses.append(urllib.request.urlopen(req, timeout=30).status)
    except urllib.error.HTTPError as err:
        statuses.append(err.code)
print(json.dumps(statuses))
"""


def as_nobody(requests: list) -> list[int]:
    out = subprocess.run(["/usr/bin/python3", "-I", "-c", AS_NOBODY, json.dumps(requests)], user=NOBODY, group=NOBODY,
                         extra_groups=[], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def gateway(home: Path, **gateway_config) -> tuple[ServiceProcess, str]:
    home.mkdir()
    base = make_config(home).model_dump(mode="json")
    config = parse_config({**base, "gateway": {**base["gateway"], **gateway_config}})
    process = ServiceProcess("gateway", write_config(home, config), config).start()
    with Client(process.endpoint, timeout_s=5) as c:
        return process, c.health()["url"]


def test_a_first_start_makes_a_key_only_its_user_reads_and_another_uid_gets_401_everywhere(run_home):
    process, url = gateway(run_home / "keys-first")
    try:
        config = process.config
        key_file = local_key_path(config)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and key_file.stat().st_uid == os.getuid()
        assert str(key_file) in process.log.read_text()  # the start says where the key is
        statuses = as_nobody([(m, url + route, body, {}) for m, route, body in TOOL_ROUTES])
        assert statuses == [401] * len(TOOL_ROUTES), statuses
        assert as_nobody([("GET", url + "/v1/models", None, {"Authorization": "Bearer mag-guessed"})]) == [401]
        key = read_local_key(config)
        # past the key check: no inference service runs behind this gateway, so 503 says "admitted"
        assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 503
        assert keys_path(config).exists() and key not in keys_path(config).read_text()  # only its hash is kept
    finally:
        process.stop()


def test_keyless_loopback_is_an_explicit_opt_in_and_logged(run_home):
    process, url = gateway(run_home / "keys-optin", allow_keyless_loopback=True)
    try:
        assert not local_key_path(process.config).exists()
        assert as_nobody([("GET", url + "/v1/models", None, {})]) == [503]  # admitted; no inference behind it
        assert "gateway_keyless" in process.log.read_text()
    finally:
        process.stop()


def test_mcp_serve_http_without_keys_makes_one_and_refuses_another_uid(run_home):
    config, command, port = mcp_http_command(run_home, "keys-mcp")
    proc = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        wait_listening(proc, port, "mcp serve listening")
        url = f"http://127.0.0.1:{port}/mcp"
        call = {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                "params": {"name": "memory_search", "arguments": {"query": "secrets"}}}
        accept = {"Accept": "application/json, text/event-stream"}
        assert as_nobody([("POST", url, call, accept)]) == [401]
        key = read_local_key(config)
        assert key and stat.S_IMODE(local_key_path(config).stat().st_mode) == 0o600
        keyed = httpx.post(url, json={"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
            "protocolVersion": "2025-03-26", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
            headers={**accept, "Authorization": f"Bearer {key}"})
        assert keyed.status_code == 200, keyed.text
    finally:
        proc.terminate()
        proc.wait(10)


def test_mcp_client_refuses_header_secrets_over_plain_http_beyond_loopback_unless_allowed():
    from shared.config import ConfigError

    def mcp(**server):
        return parse_config({"agent": {"mcp_servers": [{"name": "remote", **server}]}})
    secret = {"headers": {"Authorization": "Bearer ${REMOTE_TOKEN}"}}
    with pytest.raises(ConfigError, match="in clear.*https://.*allow_plain_http_secrets"):
        mcp(url="http://mcp.example.com/mcp", **secret)
    assert mcp(url="http://mcp.example.com/mcp", allow_plain_http_secrets=True, **secret)
    assert mcp(url="https://mcp.example.com/mcp", **secret)
    assert mcp(url="http://127.0.0.1:9000/mcp", **secret)  # loopback traffic does not leave the box
    assert mcp(url="http://mcp.example.com/mcp", headers={"X-Client": "magnitude"})  # no secret in it
