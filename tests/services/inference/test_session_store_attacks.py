"""Session files on disk (issue 23, finding 7): a forged header field, a dead writer's .tmp file."""

from __future__ import annotations

import json
import os
import struct

import pytest

from services.inference import session_store
from services.inference.session_store import SessionStore
from tests.conftest import dead_pid

pytestmark = pytest.mark.security


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
    stale = tmp_path / f"{'0' * 40}.tmp{dead_pid()}"
    stale.write_bytes(b"x" * 4096)
    live = tmp_path / f"{'1' * 40}.tmp{os.getpid()}"  # a writer that is still writing
    live.write_bytes(b"y")
    store = SessionStore(tmp_path, {"model": None}, 1 << 20)
    assert not stale.exists() and live.exists()
    stale.write_bytes(b"x" * 4096)  # and at each eviction, not only when the store opens
    assert store.save("s", [1], b"state")
    assert not stale.exists() and live.exists()
