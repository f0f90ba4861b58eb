"""How the llama.cpp processes of one box share its cores: a polite OpenMP wait, and one computation at a time.

llama.cpp's CPU backend runs on OpenMP, and inside one ``llama_decode`` its threads meet at a barrier after
every graph node (hundreds per token). How a thread waits there decides the speed:

- Spinning (libgomp's default) is fastest alone, but two processes that spin on the same cores starve each
  other: a thread spins for a peer that the kernel has descheduled to run the other process.
- Sleeping after a short spin (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=1000``) shares the cores
  well, but pays a futex wake-up at many barriers: 10% of a single stream's decode speed.

So the services spin long enough for the barriers inside a decode, and never compute at the same time: each
llama.cpp computation (a ``llama_decode`` of inference, an embedding batch) holds the ``CoreLease``, a file
lock in the stack's run directory (shared by every container of the compose stack). Measured here with
the 1.5B chat model on 2 cores, decode tok/s (``scripts/bench_core_sharing.py``, docs/benchmarks.md):

=======================================  =====  ===============================  ======================
wait policy                              alone  beside an embedding process      two decoding processes
=======================================  =====  ===============================  ======================
PASSIVE + 1000 spins, no lease           15.4   8.4 (embedding 20 batches/s)     8.7 + 8.3
PASSIVE + 30000 spins, no lease          16.2   2.5 (embedding 5 batches/s)      2.4 + 2.4
PASSIVE + 30000 spins, lease (shipped)   16.1   11.2 (embedding 11 batches/s)    7.3 + 7.2
=======================================  =====  ===============================  ======================

(libgomp's default spin, about 10x longer, ran two Gemma 270M processes at 0.8 tok/s each.) The last column
is what taking turns costs where two computations could overlap; the stack itself runs one decoding process,
which puts every session in one batch.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from shared.config import Config
from shared.security import private_dir

#: Spins before an OpenMP thread sleeps: enough for a decode's barriers (libgomp: roughly 0.3 ms), safe under the lease.
LEASED_SPIN_COUNT = "30000"
#: For llama.cpp that computes without the lease (the test suite's in-process models): sleep soon.
UNLEASED_SPIN_COUNT = "1000"


def share_cores_with_openmp(spin_count: str = LEASED_SPIN_COUNT) -> None:
    """Set the OpenMP wait policy; call before ``llama_cpp`` loads libgomp (it reads them once).

    Values already in the environment win, and so does what a parent process set: the services a test
    starts inherit the tests' shorter spin."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", spin_count)


class CoreLease:
    """Held around each llama.cpp computation, so that two processes never compute on the cores at once.

    A ``flock`` on one file of the run directory: the kernel releases it when its holder dies, so a crashed
    service never leaves it taken. Alone, a lock lets a process that computes in a tight loop take it back
    before a woken waiter runs (an embedding ingest starved the decode to 3 tok/s in some runs), so the
    lease is handed over in turns: a process waits for it while holding a second lock, the queue, which a
    holder must take before it may wait again. A thread lock in front makes it exclusive between this
    process's threads too (``flock`` is per open file, not per thread)."""

    def __init__(self, path: Path):
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self._fd = os.open(path, flags, 0o600)
        self._queue_fd = os.open(path.with_name(path.name + ".queue"), flags, 0o600)
        self._threads = threading.Lock()

    def __enter__(self) -> CoreLease:
        self._threads.acquire()
        try:
            fcntl.flock(self._queue_fd, fcntl.LOCK_EX)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            finally:
                fcntl.flock(self._queue_fd, fcntl.LOCK_UN)
        except BaseException:
            self._threads.release()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._queue_fd)


def stack_lease(config: Config) -> CoreLease:
    """The lease that every service of ``config``'s stack takes."""
    return CoreLease(private_dir(config.runtime.run_dir()) / "cores.lock")
