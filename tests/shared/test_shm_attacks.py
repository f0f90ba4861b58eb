"""Shared memory under attack (issue 16; issue 23, findings 3 and 5): a handle forged from a name listed in
/dev/shm, files planted there that stopped every start, segments of any size."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest

from shared import shm
from shared.client import Client, ServiceError
from shared.protocol import ErrorCode, ProtocolError
from tests.conftest import AS_ROOT, ServiceProcess, dead_pid, make_config, write_config

pytestmark = pytest.mark.security


@pytest.mark.model
def test_a_forged_shm_handle_is_refused(inference_service):
    owner_session, intruder = f"owner-{uuid.uuid4().hex}", f"intruder-{uuid.uuid4().hex}"
    secret = b"session A's plan: the spare key is under the blue bowl"
    handle = shm.put_bytes(secret, session_id=owner_session)
    with Client(inference_service.endpoint, timeout_s=60) as client:
        # What an intruder can learn from /dev/shm is the name; it forges the rest.
        assert handle["name"] in shm.list_segments()
        forgeries = [{"name": handle["name"], "size": len(secret), "kind": "bytes", "session": intruder},
                     {"name": handle["name"], "size": len(secret), "kind": "bytes", "key": "0" * 32},
                     {**handle, "session": intruder}]  # even the real key, claimed by another session
        for forged in forgeries:
            with pytest.raises(ServiceError) as info:
                client.request("generate", {"prompt_shm": forged, "max_tokens": 1}, session_id=intruder)
            assert info.value.code in ("not_found", "bad_request"), forged
            assert handle["name"] in shm.list_segments()  # refused, and left for its owner
    assert shm.take_bytes(handle, session_id=owner_session) == secret


def test_planted_shm_files_cannot_stop_a_service_from_starting(tmp_path):
    """Finding 3: any account may create files in /dev/shm; on main each of these made every service exit 1."""
    dead = dead_pid()
    planted = {"overflow": "mag_99999999999_0", "negative": "mag_-1_0123456789abcdef",
               "another uid's orphan": shm.segment_name(dead),
               # made in another container's PID namespace (its own /dev/shm is shared): its pid means nothing here
               "another namespace's": f"mag_{shm.PID_NAMESPACE + 1}_{dead}_{uuid.uuid4().hex[:16]}"}
    orphan = shm.segment_name(dead)  # ours, of a dead process: the sweep's real job
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
    handle = shm.put_bytes(b"word " * ((16 << 20) // 5), session_id="big")
    with Client(inference_service.endpoint, timeout_s=60) as client:
        started = time.monotonic()
        with pytest.raises(ServiceError) as info:
            client.request("generate", {"prompt_shm": handle, "max_tokens": 1}, session_id="big")
        assert info.value.code == "too_large", info.value
        assert time.monotonic() - started < 5
        assert handle["name"] not in shm.list_segments()
        assert client.generate("The robot", max_tokens=2).stats.completion_tokens >= 1
        assert client.health()["ok"]
