"""The gateway's parts without a model: API keys, the start-up refusals, error statuses, the body limit,
how stream chunks are made from inference's events, and what a request's priority becomes."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import socket
import subprocess
import sys
from fnmatch import fnmatch
from typing import get_args, get_type_hints

import msgspec
import pytest
import structlog

from services.gateway.access import Gateway, RateLimit
from services.gateway.app import create_app
from services.gateway.errors import from_service_error
from services.gateway.keys import ApiKeys, create_key, revoke_key
from services.gateway.middleware import BodyLimit
from services.gateway.replies import ChatShape, CompletionShape
from services.gateway.schemas import ResponseEvent, ResponseRequest
from services.gateway.upstream import Upstreams
from shared import protocol, shm
from shared.client import Call, ServiceError
from shared.config import dump_config, parse_config
from shared.metrics import ServiceMetrics
from shared.protocol import ChatRequest, ChatResult, decode_request
from tests.conftest import REPO, stream_event_classes


# --- API keys --------------------------------------------------------------------------------------
def test_keys_are_stored_hashed_and_checked_against_every_entry(tmp_path):
    path = tmp_path / "keys" / "api_keys"
    robot, arm = create_key(path, "robot"), create_key(path, "arm")
    text = path.read_text()
    assert robot not in text and arm not in text and oct(path.stat().st_mode & 0o777) == "0o600"
    keys = ApiKeys(path)
    assert keys.present() and keys.names() == ["robot", "arm"]
    assert keys.who(robot) == "robot" and keys.who(arm) == "arm"
    assert keys.who(robot[:-1]) is None and keys.who("") is None and keys.who("\ud800") is None
    renewed = create_key(path, "robot")  # a new key for a name replaces the old one, read without a restart
    assert keys.who(robot) is None and keys.who(renewed) == "robot"
    assert revoke_key(path, "arm") and not revoke_key(path, "arm")
    assert keys.who(arm) is None and keys.names() == ["robot"]
    with pytest.raises(ValueError, match="key name"):
        create_key(path, "no spaces")


def test_a_key_file_that_breaks_while_running_locks_everyone_out(tmp_path):
    path = tmp_path / "api_keys"
    key = create_key(path, "robot")
    keys = ApiKeys(path)
    path.write_text("robot not-a-digest and more\n")
    assert keys.present() and keys.who(key) is None and "expected 'NAME SHA256HEX'" in keys.broken
    path.unlink()  # keys existed: they stay required until a restart (issue 23, finding 4b)
    assert keys.present() and keys.broken is None and keys.who(key) is None
    assert not ApiKeys(path).present()  # a gateway started without the file needs none (on loopback)
    path.write_text("garbage\n")
    with pytest.raises(ValueError):  # at start, a malformed file stops the gateway instead
        ApiKeys(path)


# --- start-up refusals --------------------------------------------------------------------------------
def _start(tmp_path, gateway: dict) -> subprocess.CompletedProcess:
    config = parse_config({"runtime": {"runtime_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data")},
                           "metrics": {"enabled": False}, "gateway": gateway})
    path = tmp_path / "gateway.yaml"
    path.write_text(dump_config(config))
    return subprocess.run([sys.executable, "-m", "services.gateway", "--config", str(path)], capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))


def test_refuses_to_listen_beyond_loopback_without_api_keys(tmp_path):
    out = _start(tmp_path, {"host": "0.0.0.0", "port": 0})
    assert out.returncode == 1
    assert "gateway: refusing to start" in out.stderr and "scripts/ops/keys api-key" in out.stderr


def test_a_taken_port_is_a_clear_start_failure(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        out = _start(tmp_path, {"port": taken.getsockname()[1]})
    assert out.returncode == 1 and "gateway: cannot start: cannot listen on 127.0.0.1" in out.stderr


# --- errors --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("code,status", [("bad_request", 400), ("not_found", 404), ("too_large", 413),
                                         ("busy", 429), ("unavailable", 503), ("shutting_down", 503),
                                         ("timeout", 504), ("unknown_type", 501), ("internal", 500),
                                         ("something_new", 500)])
def test_mesh_errors_map_to_http_statuses(code, status):
    assert from_service_error(ServiceError(code, "why")).status == status


def test_an_unknown_model_is_model_not_found():
    err = from_service_error(ServiceError("not_found", "no model 'gpt-4o' (configured: default)"))
    assert (err.status, err.code) == (404, "model_not_found")


# --- the body limit -----------------------------------------------------------------------------------
async def _call(limit: BodyLimit, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await limit({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive, send)
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_body_limit_refuses_declared_and_chunked_bodies_and_replays_small_ones():
    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    from services.gateway.errors import error_response
    limit = BodyLimit(app, 10, max_depth=64, timeout_s=10, respond=lambda err: error_response(err, 1))
    assert asyncio.run(_call(limit, [b"12345", b"678"], [])) == (200, b"ok") and seen == [b"12345678"]
    status, body = asyncio.run(_call(limit, [b"123456", b"789012"], []))  # no Content-Length: counted
    assert status == 413 and json.loads(body)["error"]["code"] == "too_large"
    status, _ = asyncio.run(_call(limit, [b""], [(b"content-length", b"99999")]))  # refused before reading
    assert status == 413 and len(seen) == 1


# --- stream chunks ---------------------------------------------------------------------------------------
FINAL_STATS = {"prompt_tokens": 20, "cached_tokens": 12, "prefill_tokens": 8, "completion_tokens": 5,
               "ttft_s": 0.05, "total_s": 0.25, "prefill_tps": 160.0, "decode_tps": 25.0, "settings_id": "abc",
               "model": "m"}


def _dump(chunks) -> list[dict]:
    return [json.loads(c.model_dump_json(exclude_none=True)) for c in chunks]


def test_chat_stream_chunks_carry_text_tool_calls_and_usage_last():
    shape = ChatShape("m")
    chunks = shape.opening() + shape.on_event({"text": "Let me check."})
    chunks += shape.on_event({"tool_call": {"index": 0, "id": "call_1", "name": "move_to",
                                            "arguments": '{"room": "kitchen"}'}})
    final = {"stats": FINAL_STATS, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "move_to", "arguments": '{"room": "kitchen"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "look", "arguments": "{}"}}]}}
    out = _dump(chunks + shape.closing(shape.read(final)))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert out[1]["choices"][0]["delta"] == {"content": "Let me check."}
    assert out[2]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "id": "call_1", "type": "function", "function": {
        "name": "move_to", "arguments": '{"room": "kitchen"}'}}]
    assert out[3]["choices"][0]["delta"]["tool_calls"][0]["index"] == 1  # in the result, never streamed: sent now
    last = out[-1]
    assert last["choices"][0]["finish_reason"] == "tool_calls" and last["system_fingerprint"] == "abc"
    assert last["usage"] == {"prompt_tokens": 20, "completion_tokens": 5, "total_tokens": 25,
                             "prompt_tokens_details": {"cached_tokens": 12}}
    assert last["timings"]["cache_n"] == 12 and last["timings"]["prompt_n"] == 8
    assert all("usage" not in c for c in out[:-1]) and len({c["id"] for c in out}) == 1


def test_include_usage_moves_usage_to_a_chunk_without_choices():
    shape = CompletionShape("m", include_usage=True, echo="Hi")
    out = _dump(shape.opening() + shape.on_event({"text": " there"}) + shape.closing(
        shape.read({"text": " there", "stats": {**FINAL_STATS, "stop_reason": "eos"}})))
    assert [c["choices"][0]["text"] for c in out[:-1]] == ["Hi", " there", ""]
    assert out[-2]["choices"][0]["finish_reason"] == "stop" and "usage" not in out[-2]
    assert out[-1]["choices"] == [] and out[-1]["usage"]["total_tokens"] == 25


def test_the_listening_socket_says_tcp_so_asyncio_turns_nagle_off():
    """With proto 0 asyncio leaves Nagle on, and every keep-alive response waited ~40 ms for a delayed ACK."""
    from services.gateway.service import bind
    sock = bind("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()


# --- priority: the body field, the header, /v1/responses --------------------------------------------------
class _Recorded(Upstreams):
    """Inference and tools answered here: what each request carried is kept in ``sent``."""

    REPLIES = {"generate": {"text": "ok", "stats": {**FINAL_STATS, "stop_reason": "eos"}},
               "chat": {"stats": FINAL_STATS, "finish_reason": "stop",
                        "message": {"role": "assistant", "content": "ok"}},
               "tool.list": {"tools": []}, "health": {"n_ctx": 2048}, "tokenize": {"tokens": [1, 2]}}

    def __init__(self, config):
        super().__init__(config)
        self.sent: list[tuple[str, dict]] = []

    async def exchange(self, service, msg_type, body=None, session_id=None, deadline=None):
        self.sent.append((msg_type, body or {}))
        if msg_type not in self.REPLIES:
            raise ServiceError("unavailable", f"{service} is not running here")
        return self.REPLIES[msg_type]


def _gateway(tmp_path, upstreams_class: type[_Recorded] = _Recorded) -> tuple[object, _Recorded]:
    config = parse_config({"runtime": {"runtime_dir": str(tmp_path / "run"), "data_dir": str(tmp_path / "data")},
                           "metrics": {"enabled": False}, "gateway": {"allow_keyless_loopback": True}})
    upstreams = upstreams_class(config)
    gw = Gateway(config, upstreams, ApiKeys(tmp_path / "api_keys"), True,
                 ServiceMetrics("gateway", os.getpid(), queue_depth=lambda: 0, running=lambda: 0,
                                uptime_s=lambda: 0), structlog.get_logger("test"),
                 RateLimit(10))
    return create_app(gw, lambda: None, lambda n: None), upstreams


def _post(app, path: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    async def call():
        data = json.dumps(body).encode()
        raw = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(data)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        sent, messages = [], [{"type": "http.request", "body": data, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        await app({"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b"",
                   "headers": raw, "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000), "scheme": "http",
                   "http_version": "1.1", "root_path": "", "state": {}}, receive, send)
        return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    return asyncio.run(call())


def test_priority_reaches_inference_from_the_body_or_the_header_and_the_body_wins(tmp_path):
    app, upstreams = _gateway(tmp_path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    cases = [("/v1/chat/completions", chat, {}, "normal"),  # the default, said
             ("/v1/chat/completions", {**chat, "priority": "interactive"}, {}, "interactive"),
             ("/v1/chat/completions", chat, {"X-Priority": "background"}, "background"),
             ("/v1/chat/completions", {**chat, "priority": "normal"}, {"X-Priority": "background"}, "normal"),
             ("/v1/completions", {"model": "m", "prompt": "hi", "priority": "background"}, {}, "background"),
             ("/v1/completions", {"model": "m", "prompt": "hi"}, {"X-Priority": "interactive"}, "interactive")]
    for path, body, headers, expected in cases:
        status, reply = _post(app, path, body, headers)
        assert status == 200, reply
        assert upstreams.sent[-1][1].priority == expected, (path, body, headers)


def test_a_bad_priority_is_a_400_naming_it(tmp_path):
    app, upstreams = _gateway(tmp_path)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for body, headers, param in (({**chat, "priority": "urgent"}, {}, "priority"),
                                 ({**chat, "priority": 1}, {}, "priority"),
                                 (chat, {"X-Priority": "now"}, "X-Priority")):
        status, reply = _post(app, "/v1/chat/completions", body, headers)
        assert status == 400 and reply["error"]["param"] == param, reply
    status, reply = _post(app, "/v1/responses", {"input": "hi", "priority": "soon"})
    assert status == 400 and reply["error"]["param"] == "priority", reply
    assert upstreams.sent == []


def test_every_model_step_of_a_response_run_has_its_priority(tmp_path):
    app, upstreams = _gateway(tmp_path)
    for body, headers, expected in (({"input": "hi", "priority": "background"}, {}, "background"),
                                    ({"input": "hi"}, {"X-Priority": "interactive"}, "interactive")):
        upstreams.sent.clear()
        status, reply = _post(app, "/v1/responses", {**body, "store": False}, headers)
        assert status == 200 and reply["status"] == "completed", reply
        chats = [b for t, b in upstreams.sent if t == "chat"]
        assert chats and all(b.priority == expected for b in chats), upstreams.sent


# --- a step's several calls of the caller's tools: handed out together ---------------------------------------
THERMOMETER = {"type": "function", "name": "read_thermometer", "description": "Reads a room's thermometer.",
               "parameters": {"type": "object", "properties": {"room": {"type": "string"}}, "required": ["room"]}}


class _TwoCalls(_Recorded):
    """A model that calls the caller's thermometer twice in one reply, saying so, then answers with a figure
    nothing backs (the step policy sends it back), then answers."""

    def __init__(self, config):
        super().__init__(config)
        calls = [{"id": f"m{i}", "type": "function",
                  "function": {"name": "read_thermometer", "arguments": json.dumps({"room": room})}}
                 for i, room in enumerate(("kitchen", "hall"))]
        self.steps = [({"role": "assistant", "content": "Reading both.", "tool_calls": calls}, "tool_calls"),
                      ({"role": "assistant", "content": "It is 30 °C in both."}, "stop"),
                      ({"role": "assistant", "content": "The kitchen has 21.5 °C and the hall 19 °C."}, "stop")]
        self.prompts: list[list[dict]] = []  # each step's messages

    async def exchange(self, service, msg_type, body=None, session_id=None, deadline=None):
        if msg_type == "chat" and body.response_format is None:  # a step (not one of the policy's questions)
            self.prompts.append(msgspec.to_builtins(body)["messages"])
            message, finish = self.steps.pop(0)
            return {"stats": FINAL_STATS, "finish_reason": finish, "message": message}
        return await super().exchange(service, msg_type, body, session_id, deadline)


def test_a_step_with_two_calls_of_the_callers_tools_hands_both_out_and_resumes_on_both_outputs(tmp_path):
    app, upstreams = _gateway(tmp_path, _TwoCalls)
    status, waiting = _post(app, "/v1/responses", {"input": "How warm are the kitchen and the hall?",
                                                   "tools": [THERMOMETER], "store": False})
    assert status == 200 and waiting["status"] == "requires_action", waiting
    calls = [item for item in waiting["output"] if item["type"] == "function_call"]
    assert [json.loads(c["arguments"]) for c in calls] == [{"room": "kitchen"}, {"room": "hall"}], calls
    assert len({c["call_id"] for c in calls}) == 2
    outputs = [{"type": "function_call_output", "call_id": c["call_id"], "output": celsius}
               for c, celsius in zip(calls, ('{"celsius": 21.5}', '{"celsius": 19}'))]
    status, refused = _post(app, "/v1/responses", {"previous_response_id": waiting["id"], "input": outputs[:1]})
    assert status == 400 and refused["error"]["param"] == "input", refused
    assert calls[1]["call_id"] in refused["error"]["message"], refused
    status, done = _post(app, "/v1/responses", {"previous_response_id": waiting["id"], "input": outputs[::-1]})
    assert status == 200 and done["status"] == "completed", done
    # the answer is the one message: the reply sent back and the text beside the calls stay in the run (clients
    # join every message of a response into its text)
    assert [item["type"] for item in waiting["output"]] == ["function_call", "function_call"], waiting["output"]
    assert [item["content"][0]["text"] for item in done["output"] if item["type"] == "message"] == [
        "The kitchen has 21.5 °C and the hall 19 °C."], done["output"]
    told = [m for m in upstreams.prompts[-1] if m["role"] == "tool"]
    assert [(m["tool_call_id"], m["content"]) for m in told] == [
        ("m0", '{"celsius": 21.5}'), ("m1", '{"celsius": 19}')], told  # each output in its call's place


def test_the_agent_alias_hands_out_a_steps_two_calls_in_one_completion(tmp_path):
    app, _ = _gateway(tmp_path, _TwoCalls)
    status, reply = _post(app, "/v1/chat/completions", {
        "model": "m:agent", "messages": [{"role": "user", "content": "How warm are the kitchen and the hall?"}],
        "tools": [{"type": "function", "function": {k: v for k, v in THERMOMETER.items() if k != "type"}}]})
    assert status == 200 and reply["choices"][0]["finish_reason"] == "tool_calls", reply
    calls = reply["choices"][0]["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"room": "kitchen"}, {"room": "hall"}]


class _Counting:
    """``shared.protocol``'s encoder, counting the frames it encodes."""

    def __init__(self, encoder):
        self.encoder, self.frames = encoder, 0

    def encode(self, value):
        self.frames += 1
        return self.encoder.encode(value)


def test_a_chat_body_is_validated_once_on_each_side_of_the_gateway_to_inference_boundary(tmp_path, monkeypatch):
    """The gateway's one validation of a chat is its HTTP model's (pydantic): it builds the wire struct from it,
    with no msgspec validation of the request and no dict round trip; the frame is encoded once, its size read
    from that encode (no size probe); inference validates it once, as it decodes it into ``ChatRequest``."""
    conversions, convert = [], msgspec.convert

    def counting(value, into, **kw):
        conversions.append(into)
        return convert(value, into, **kw)
    monkeypatch.setattr(msgspec, "convert", counting)
    encoder = _Counting(protocol._encoder)
    monkeypatch.setattr(protocol, "_encoder", encoder)
    app, upstreams = _gateway(tmp_path)
    tool = {"type": "function", "function": {"name": "look", "parameters": {"type": "object"}}}
    status, reply = _post(app, "/v1/chat/completions", {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "auto"})
    assert status == 200, reply
    [(msg_type, body)] = upstreams.sent
    assert msg_type == "chat" and isinstance(body, ChatRequest) and body.tools[0].function.name == "look"
    assert conversions == [ChatResult]  # the gateway's only msgspec validation: reading inference's reply
    conversions.clear()
    frame = Call("ipc://nowhere", "chat", body, "s1", None, 1.0).frame  # as the gateway's client sends it
    assert encoder.frames == 1
    request = decode_request(frame, max_frame_bytes=1 << 20, handled={"chat"})
    assert conversions == [ChatRequest] and request.message == body  # inference: one validation, the same body
    # A conversation over the inline limit: the frame said so, and its messages go in shared memory instead.
    conversions.clear()
    encoder.frames = 0
    monkeypatch.setattr(shm, "INLINE_LIMIT_BYTES", 16)
    spilled = decode_request(Call("ipc://nowhere", "chat", body, "s1", None, 1.0).frame, max_frame_bytes=1 << 20,
                             handled={"chat"}).message
    assert encoder.frames == 2 and spilled.messages is None and conversions == [ChatRequest]
    data = shm.take_bytes(spilled.messages_shm, "s1", max_bytes=1 << 20)
    assert protocol.decode_messages(data, "r1") == body.messages and conversions[1:] == [protocol.Messages]
    # To inference on another box (a LAN inference node) the same conversation goes whole: no shm there.
    for endpoint, whole in (("tcp://10.0.0.7:5555", True), ("tcp://inference-box:5555", True),
                            ("tcp://127.0.0.1:5555", False)):
        sent = decode_request(Call(endpoint, "chat", body, "s1", None, 1.0).frame, max_frame_bytes=1 << 20,
                              handled={"chat"}).message
        assert (sent.messages == body.messages) is whole and (sent.messages_shm is None) is whole, endpoint
        if not whole:
            shm.unlink(sent.messages_shm["name"])


# --- docs/gateway.md's Responses API tables, against the code -------------------------------------------------
def doc_table(header: str) -> list[tuple[list[str], str]]:
    """The rows of the docs/gateway.md table under ``header``: the names written in code in the first cell, and
    the second cell."""
    lines = (REPO / "docs" / "gateway.md").read_text().splitlines()
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[lines.index(header) + 2:])
    return [(re.findall(r"`([^`]+)`", first), here) for first, here in (row[2:-2].split(" | ") for row in rows)]


def test_the_responses_tables_name_every_field_and_event_as_the_code_handles_it():
    openai = pytest.importorskip("openai", reason="the official client is in the test extra")
    from openai.types.responses.response_create_params import ResponseCreateParamsBase

    fields, ours = doc_table("| Request field | Here |"), set(ResponseRequest.model_fields)
    named = {name for names, _ in fields for name in names}
    assert ours | set(get_type_hints(ResponseCreateParamsBase)) <= named, openai.__version__
    for names, here in fields:  # supported: a field of the schema; 400: one it refuses (it forbids extras)
        assert set(names) <= ours if here.startswith("supported") else not set(names) & ours, names

    events = doc_table("| Stream event | Here |")
    sent = {name for names, here in events if here.startswith("supported") for name in names}
    assert sent == set(get_args(ResponseEvent.model_fields["type"].annotation))
    patterns = [name for names, _ in events for name in names]
    assert [kind for kind in stream_event_classes() if not any(fnmatch(kind, p) for p in patterns)] == []
