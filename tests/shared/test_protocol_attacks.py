"""Objects on the wire (issue 23, finding 8): no pickle anywhere, plain msgpack values only."""

from __future__ import annotations

import ast
import pickle

import msgpack
import pytest

from shared.protocol import PROTOCOL_VERSION, ErrorCode, ProtocolError, decode_request
from tests.conftest import REPO

pytestmark = pytest.mark.security


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
