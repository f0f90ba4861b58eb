"""Issue 34, finding 4: a JSON depth bomb filled the disk. 900 levels of nesting in a request (2 KB) raised
RecursionError in the gateway (a 500), each logged a ~300 KB traceback, and log files grew forever.

Now the gateway refuses a body nested deeper than ``gateway.max_json_depth`` before anything parses it, the
mesh refuses a body deeper than ``MAX_BODY_DEPTH``, a traceback in the log is capped, and a service's log
file is rotated by size (``runtime.log_max_bytes``, ``runtime.log_backups``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import msgpack
import pytest
import yaml

from services.gateway.keys import create_key
from shared import process
from shared.client import Client, ServiceError
from shared.config import dump_config, parse_config
from tests.conftest import REPO, ServiceProcess, make_config, wait_for, write_config

BOMB_DEPTH = 900


def nested(depth: int, leaf=1):
    """``depth`` levels of objects and arrays, alternating, around ``leaf``."""
    value = leaf
    for level in range(depth):
        value = {"a": value} if level % 2 else [value]
    return value


# --- the gateway: a 400 before any recursion, and (almost) nothing in the log ----------------------------
@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """A gateway process with nothing behind it: the bombs never get past its validation."""
    home = Path(tmp_path_factory.mktemp("depth", numbered=True))
    key = create_key(home / "api_keys", "robot")
    base = make_config(home).model_dump(mode="json")
    config = parse_config({**base, "gateway": {**base["gateway"], "api_keys_file": str(home / "api_keys")}})
    proc = ServiceProcess("gateway", write_config(home, config), config).start()
    with Client(proc.endpoint, timeout_s=5) as c:
        url = c.health()["url"]
    yield proc, url, {"Authorization": f"Bearer {key}"}
    proc.stop()


BOMBS = {
    "chat tools[].parameters": ("/v1/chat/completions", {
        "model": "any", "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "x": nested(BOMB_DEPTH)}}}]}),
    "feedback.details": ("/v1/feedback", {"session_id": "run-1", "success": False,
                                          "details": {"x": nested(BOMB_DEPTH)}}),
}


@pytest.mark.parametrize("bomb", BOMBS)
def test_a_depth_bomb_is_a_400_naming_the_limit_with_under_2_kb_of_log(gateway, bomb):
    proc, url, headers = gateway
    route, body = BOMBS[bomb]
    logged = proc.log.stat().st_size
    answer = httpx.post(url + route, json=body, headers=headers, timeout=30)
    time.sleep(0.5)  # what the gateway logs after it answered
    assert answer.status_code == 400, answer.text[:500]
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and "gateway.max_json_depth" in error["message"], error
    assert proc.log.stat().st_size - logged < 2048, proc.log.read_text()[logged:logged + 2000]


def test_the_depth_scan_counts_brackets_outside_strings_only():
    from services.gateway.middleware import json_depth
    assert json_depth(b'{"a": [1, {"b": []}], "c": {}}') == 4
    assert json_depth(json.dumps({"s": "[[[{{{\\\"[[", "t": ["\\", "]]]"]}).encode()) == 2
    assert json_depth(b'[{"a": ' * 2500 + b"1" + b"}]" * 2500) == 5000
    assert json_depth(b'"just a string"') == json_depth(b"") == 0


def test_the_body_limit_passes_a_body_at_the_depth_limit_and_refuses_one_deeper():
    from services.gateway.errors import error_response
    from services.gateway.middleware import BodyLimit
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def call(body: bytes) -> int:
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        limit = BodyLimit(app, max_bytes=1 << 20, timeout_s=10, respond=lambda err: error_response(err, 1),
                          max_depth=8)
        await limit({"type": "http", "method": "POST", "path": "/", "headers": []}, receive, send)
        return sent[0]["status"]

    assert asyncio.run(call(json.dumps(nested(8)).encode())) == 200 and len(seen) == 1
    assert asyncio.run(call(json.dumps(nested(9)).encode())) == 400 and len(seen) == 1


def test_big_integers_become_floats_at_any_depth_without_recursion():
    from services.gateway.schemas import _mesh_numbers
    deep = nested(5000, leaf=2**70)
    converted = _mesh_numbers(deep)
    for level in range(5000):
        converted = converted[0] if isinstance(converted, list) else converted["a"]
    assert converted == float(2**70) and isinstance(converted, float)


# --- the mesh: a frame nested past MAX_BODY_DEPTH is a bad request ------------------------------------
def test_the_mesh_refuses_a_body_nested_past_its_depth_bound():
    from shared.protocol import MAX_BODY_DEPTH, PROTOCOL_VERSION, ProtocolError, decode_request

    def decode(depth: int):  # the body's own map and details' are two of the levels
        body = {"session_id": "s", "success": True, "details": {"x": nested(depth - 2)}}
        frame = msgpack.packb({"v": PROTOCOL_VERSION, "id": "r1", "type": "feedback", "body": body})
        return decode_request(frame, max_frame_bytes=1 << 20, handled={"feedback"})

    assert decode(MAX_BODY_DEPTH).body["details"]
    for depth in (MAX_BODY_DEPTH + 1, 1000):  # msgpack itself unpacks up to 1024 levels
        with pytest.raises(ProtocolError) as info:
            decode(depth)
        assert info.value.code == "bad_request" and info.value.request_id == "r1"
        assert f"deeper than {MAX_BODY_DEPTH}" in info.value.message


# --- the log: tracebacks capped, files rotated by size ---------------------------------------------------
#: A process that logs one RecursionError through structlog and one through the standard library (as uvicorn
#: logs an exception that escaped the app): the ~300 KB traceback of a 900-deep walk, twice.
RECURSION = """
import logging
from shared.logs import configure_logging

def walk(value):
    return {k: walk(v) for k, v in value.items()} if isinstance(value, dict) else value

deep = 1
for _ in range(5000):
    deep = {"a": deep}
log = configure_logging("test")
try:
    walk(deep)
except RecursionError as exc:
    log.error("handler_failed", exc_info=exc)
    logging.getLogger("uvicorn.error").error("Exception in ASGI application", exc_info=exc)
"""


def test_a_traceback_in_the_log_is_capped_and_keeps_its_first_and_last_frames():
    out = subprocess.run([sys.executable, "-c", RECURSION], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stderr.splitlines()
    assert len(out.stderr) < 40_000, f"{len(out.stderr)} bytes of log"
    events = [json.loads(line) for line in lines]  # every line an event, the standard library's too
    assert [e["event"] for e in events] == ["handler_failed", "Exception in ASGI application"]
    for event in events:
        trace = event["exception"]
        assert trace.startswith("Traceback") and "in <module>" in trace  # where it started
        assert trace.splitlines()[-1].startswith("RecursionError: maximum recursion depth exceeded")  # its end
        assert "characters cut" in trace


def _rotation_env(path: Path, max_bytes: int, backups: int) -> dict[str, str]:
    from shared.logs import rotation_env
    return dict(os.environ, PYTHONPATH=str(REPO), **rotation_env(path, max_bytes, backups))


#: Logs ~100 KB in events of ~200 bytes, then writes to fd 2 directly (as llama.cpp's C code does), then logs.
CHATTY = """
import os
from shared.logs import configure_logging
log = configure_logging("test")
for i in range(500):
    log.info("step", i=i, pad="x" * 150)
os.write(2, b"written by C after the rotations\\n")
log.info("last")
"""


def test_a_log_past_its_limit_is_rotated_into_bounded_files_and_fd_2_follows(tmp_path):
    path, max_bytes, backups = tmp_path / "test.log", 8192, 2
    with open(path, "ab") as log:
        subprocess.run([sys.executable, "-c", CHATTY], stdout=log, stderr=log, timeout=60, check=True,
                       env=_rotation_env(path, max_bytes, backups), cwd=REPO)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["test.log", "test.log.1", "test.log.2"], files
    for name in files:
        assert (tmp_path / name).stat().st_size < max_bytes + 512, name  # the limit, and one event past it
    newest = path.read_text()
    assert "written by C after the rotations" in newest and '"event": "last"' in newest
    assert '"i": 499' in newest + (tmp_path / "test.log.1").read_text()
    assert '"i": 0,' not in "".join((tmp_path / name).read_text() for name in files)  # the oldest are gone


def test_a_spawned_service_rotates_its_log_file(tmp_path):
    """Through ``process.spawn``: a gateway whose log file is already over the limit starts a new one."""
    config = parse_config({**make_config(tmp_path).model_dump(mode="json"),
                           "runtime": {"runtime_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data"),
                                       "log_max_bytes": 65536, "log_backups": 1}})
    config_path = tmp_path / "gateway.yaml"
    config_path.write_text(dump_config(config))
    log = process.log_file(config, "gateway")
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("an old line\n" * 6000)  # 72 KB
    proc = process.spawn(config, "gateway", str(config_path), {})
    try:
        with Client(config.runtime.endpoint("gateway"), timeout_s=2) as c:
            wait_for(lambda: _healthy(c), 60, "gateway healthy")
        wait_for(lambda: "gateway_listening" in log.read_text(), 10, "the gateway's start in the new file")
    finally:
        process.stop(config, "gateway")
        proc.wait(30)
    rotated = Path(f"{log}.1").read_text()
    assert rotated.startswith("an old line\n") and "an old line" not in log.read_text()
    assert not Path(f"{log}.2").exists()


def _healthy(client: Client) -> bool:
    try:
        return client.health()["ok"]
    except ServiceError:  # not listening yet
        return False


def test_compose_bounds_every_container_log():
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        logging = service.get("logging", {})
        options = logging.get("options", {})
        assert logging.get("driver") == "json-file" and options.get("max-size") and options.get("max-file"), name
