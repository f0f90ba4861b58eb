import multiprocessing as mp
import os

import numpy as np
import pytest

from shared import codecs, shm
from shared.protocol import ErrorCode, ProtocolError


def test_bytes_round_trip_and_single_take():
    handle = shm.put_bytes(b"hello" * 1000)
    assert handle["name"] in shm.list_segments()
    assert shm.take_bytes(handle) == b"hello" * 1000
    assert handle["name"] not in shm.list_segments()
    with pytest.raises(ProtocolError) as info:
        shm.take_bytes(handle)
    assert info.value.code == ErrorCode.NOT_FOUND


def test_array_round_trip():
    arr = np.random.default_rng(0).standard_normal((64, 384)).astype(np.float32)
    out = codecs.take_array(codecs.put_array(arr))
    assert out.dtype == np.float32 and np.array_equal(out, arr)


@pytest.mark.parametrize("handle", [None, {"name": 3}, {"name": "/etc/passwd", "size": 1},
                                    {"name": "mag_1_nothere", "size": 1}, {"name": "mag_1_x", "size": -1}])
def test_bad_handles_are_typed_errors(handle):
    with pytest.raises(ProtocolError) as info:
        shm.take_bytes(handle)
    assert info.value.code in (ErrorCode.BAD_REQUEST, ErrorCode.NOT_FOUND)


def test_array_handle_lying_about_shape():
    handle = codecs.put_array(np.zeros(10, dtype=np.float32))
    handle["shape"] = [1000]
    with pytest.raises(ProtocolError):
        codecs.take_array(handle)
    assert handle["name"] not in shm.list_segments()


def _leak_and_die(conn):
    conn.send(shm.put_bytes(b"x" * 4096)["name"])
    os._exit(0)  # crash-like exit: no cleanup runs


def test_sweep_removes_segments_of_dead_processes():
    parent, child = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_leak_and_die, args=(child,))
    proc.start()
    assert parent.poll(10)
    name = parent.recv()
    proc.join(10)
    assert name in shm.list_segments()
    mine = shm.put_bytes(b"alive")  # owned by this live process: must survive the sweep
    assert name in shm.sweep_orphans()
    assert name not in shm.list_segments() and mine["name"] in shm.list_segments()
    shm.take_bytes(mine)


def test_pool_reaps_untaken_segments():
    pool = shm.ShmPool(ttl_s=0)
    handle = shm.put_bytes(b"never taken", pool)
    assert pool.reap(now=float("inf")) == 1
    assert handle["name"] not in shm.list_segments()


def test_handle_of_another_session_is_refused_and_kept_for_its_owner():
    handle = shm.put_bytes(b"session A's tool output", session_id="A")
    for other in ("B", None):
        with pytest.raises(ProtocolError) as info:
            shm.take_bytes(handle, session_id=other)
        assert info.value.code == ErrorCode.NOT_FOUND and "another session" in info.value.message
    assert shm.take_bytes(handle, session_id="A") == b"session A's tool output"
