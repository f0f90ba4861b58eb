"""The core lease: one llama.cpp computation at a time across the stack's processes, never left taken."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from shared.cores import CoreLease

HOLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from shared.cores import CoreLease
lease = CoreLease(Path({path!r}))
lease.__enter__()
print("held", flush=True)
time.sleep(60)
"""


def _holder(tmp_path, repo):
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=repo, path=str(tmp_path / "cores.lock"))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _acquire_in_thread(lease: CoreLease) -> threading.Event:
    got = threading.Event()

    def take():
        with lease:
            got.set()
    threading.Thread(target=take, daemon=True).start()
    return got


def test_a_second_process_waits_and_a_dead_holder_frees_the_lease(tmp_path):
    from tests.conftest import REPO
    holder = _holder(tmp_path, str(REPO))
    lease = CoreLease(tmp_path / "cores.lock")
    try:
        got = _acquire_in_thread(lease)
        assert not got.wait(0.5), "the lease was taken while another process held it"
        holder.kill()  # a crashed service: the kernel drops its lock
        holder.wait()
        assert got.wait(5), "a dead holder left the lease taken"
    finally:
        holder.kill()
        lease.close()


def test_threads_of_one_process_take_turns(tmp_path):
    lease = CoreLease(tmp_path / "cores.lock")
    try:
        with lease:
            got = _acquire_in_thread(lease)
            time.sleep(0.3)
            assert not got.is_set(), "two threads of one process held the lease at once"
        assert got.wait(5)
    finally:
        lease.close()
