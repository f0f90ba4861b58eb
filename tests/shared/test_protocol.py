import re
from typing import get_args, get_type_hints

import msgpack
import msgspec
import pytest

from shared.protocol import (
    MESSAGES, PROTOCOL_VERSION, ErrorCode, GenerateRequest, ProtocolError, Stats, decode_reply, decode_request,
    encode_error, encode_reply, encode_request,
)
from tests.conftest import REPO

HANDLED = {"health", "generate"}


def decode(frame, limit=1 << 20):
    return decode_request(frame, max_frame_bytes=limit, handled=HANDLED)


def code_of(frame, limit=1 << 20):
    with pytest.raises(ProtocolError) as info:
        decode(frame, limit)
    return info.value.code


def test_round_trip():
    req = decode(encode_request("generate", {"prompt": "hi", "max_tokens": 3}, session="s1", request_id="r1"))
    assert (req.id, req.type, req.session, req.message) == ("r1", "generate", "s1",
                                                            GenerateRequest(prompt="hi", max_tokens=3))
    ok = decode_reply(encode_reply("r1", "ok", {"text": "x"}))
    assert ok.final and ok.body == {"text": "x"}
    ev = decode_reply(encode_reply("r1", "event", {"text": "x"}))
    assert not ev.final
    err = decode_reply(encode_error("r1", ErrorCode.BUSY, "full"))
    assert (err.kind, err.error_code, err.error_message) == ("error", "busy", "full")


@pytest.mark.parametrize("frame", [b"\xc1garbage", b"", b"\x00\x01\x02"])
def test_garbage_is_bad_frame(frame):
    assert code_of(frame) == ErrorCode.BAD_FRAME


def test_truncated_msgpack_is_bad_frame():
    assert code_of(encode_request("health")[:-3]) == ErrorCode.BAD_FRAME


def test_non_map_is_bad_frame():
    assert code_of(msgpack.packb([1, 2, 3])) == ErrorCode.BAD_FRAME


def test_wrong_version():
    assert code_of(encode_request("health", version=PROTOCOL_VERSION + 1)) == ErrorCode.BAD_VERSION


def test_unknown_type():
    assert code_of(encode_request("teleport")) == ErrorCode.UNKNOWN_TYPE


def test_oversized_frame():
    assert code_of(encode_request("generate", {"prompt": "x" * 5000}), limit=4096) == ErrorCode.TOO_LARGE


def test_missing_id():
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "type": "health", "body": {}})
    assert code_of(frame) == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize("body,needle", [
    ({"prompt": 5}, "'prompt' must be str"),
    ({"prompt": "x", "max_tokens": "many"}, "'max_tokens'"),
    ({"prompt": "x", "max_tokens": True}, "'max_tokens' must be int, got bool"),
    ({"prompt": "x", "temperature": float("nan")}, "'temperature' must be float >= 0.0"),  # nan is in no range
    ({"prompt": "x", "temperature": float("inf")}, "'temperature' must be float <= 2.0"),
    ({"prompt": "x", "stop": ["a"] * 17}, "'stop' must be array of length <= 16"),
    ({"prompt": "x", "stop": [""]}, "'stop[0]' must be str of length >= 1"),
    ({"prompt": "x", "priority": "urgent"}, "'priority' must be one of its values, not 'urgent'"),
    ({"prompt": "x", "priority": 1}, "'priority' must be str"),
    ({"prompt": "x", "max_token": 5}, "body has an unknown field max_token"),
])
def test_field_types_checked(body, needle):
    with pytest.raises(ProtocolError) as info:
        decode(encode_request("generate", body))
    assert info.value.code == ErrorCode.BAD_REQUEST and needle in info.value.message


def test_every_priority_is_accepted_on_generate_and_chat():
    for msg_type, body in (("generate", {"prompt": "x"}), ("chat", {"messages": [{"role": "user"}]})):
        for priority in ("interactive", "normal", "background"):
            req = decode_request(encode_request(msg_type, {**body, "priority": priority}), max_frame_bytes=1 << 20,
                                 handled={msg_type})
            assert req.message.priority == priority


def test_missing_required_field():
    with pytest.raises(ProtocolError) as info:
        decode_request(encode_request("tokenize", {}), max_frame_bytes=1 << 20, handled={"tokenize"})
    assert info.value.code == ErrorCode.BAD_REQUEST and "missing required field 'text'" in info.value.message


def test_error_keeps_request_id():
    with pytest.raises(ProtocolError) as info:
        decode(encode_request("teleport", request_id="abc"))
    assert info.value.request_id == "abc"


def test_oversized_frame_error_carries_the_request_id():
    """A too-large request is answered under its own id: a client drops replies whose id it does not know,
    so an id-less too_large left the caller waiting for a reply that never came."""
    frame = encode_request("generate", {"prompt": "x" * 50_000}, request_id="req-big-1")
    with pytest.raises(ProtocolError) as err:
        decode_request(frame, max_frame_bytes=4096, handled=HANDLED)
    assert err.value.code == ErrorCode.TOO_LARGE
    assert err.value.request_id == "req-big-1"
    # The id is found wherever the encoder put it, and a frame with no id (or garbage) gets none, no crash.
    body_first = msgpack.packb({"body": {"prompt": "x" * 50_000}, "v": PROTOCOL_VERSION, "type": "generate", "id": "req-big-2"})
    with pytest.raises(ProtocolError) as err:
        decode_request(body_first, max_frame_bytes=4096, handled=HANDLED)
    assert err.value.request_id == "req-big-2"
    with pytest.raises(ProtocolError) as err:
        decode_request(b"\xc1" * 5000, max_frame_bytes=4096, handled=HANDLED)
    assert err.value.code == ErrorCode.TOO_LARGE and err.value.request_id is None


# --- docs/protocol.md against the typed messages ----------------------------------------------------------------
def _structs(tp) -> set[type]:
    """The Structs a type is made of: itself and those of its fields, at any depth."""
    found: set[type] = set()
    todo = [tp]
    while todo:
        t = todo.pop()
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            if t not in found:
                found.add(t)
                todo += get_type_hints(t, include_extras=True).values()
        else:
            todo += get_args(t)
    return found


def _row(msg_type: str) -> tuple[set[str], set[str]]:
    """The names written in code in the docs/protocol.md message table's row of ``msg_type`` (``{role, content}``
    names two): in its fields cell, in its reply cell."""
    line = next(line for line in (REPO / "docs" / "protocol.md").read_text().splitlines()
                if line.startswith(f"| `{msg_type}` |"))
    cells = [{name for code in re.findall(r"`([^`]+)`", cell) for name in re.findall(r"\w+", code)}
             for cell in line.split(" | ")]
    return cells[2], cells[3]


@pytest.mark.parametrize("msg_type", [t for t, spec in MESSAGES.items() if spec.body is not None])
def test_the_protocol_doc_names_every_field_of_the_typed_messages(msg_type):
    spec = MESSAGES[msg_type]
    fields_cell, reply_cell = _row(msg_type)
    for cell, struct_type in ((fields_cell, spec.body), (reply_cell, spec.result)):
        for struct in _structs(struct_type) - ({Stats} if msg_type != "generate" else set()):
            missing = set(struct.__struct_fields__) - cell
            assert not missing, f"docs/protocol.md's {msg_type} row does not name {struct.__name__}'s {missing}"
    text = (REPO / "docs" / "protocol.md").read_text()
    assert f"(version {PROTOCOL_VERSION})" in text.splitlines()[0] and f"must be `{PROTOCOL_VERSION}`" in text
