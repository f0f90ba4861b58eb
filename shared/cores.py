"""How the llama.cpp processes of one box share its cores: a polite OpenMP wait, and one computation at a time.

llama.cpp's CPU backend runs on OpenMP, and inside one ``llama_decode`` its threads meet at a barrier after
every graph node (hundreds per token). How a thread waits there decides the speed:

- Spinning (libgomp's default) is fastest alone, but two processes that spin on the same cores starve each
  other: a thread spins for a peer that the kernel has descheduled to run the other process.
- Sleeping after a short spin (``OMP_WAIT_POLICY=PASSIVE``, ``GOMP_SPINCOUNT=1000``) shares the cores
  well, but pays a futex wake-up at many barriers: 10% of a single stream's decode speed.

So the services spin long enough for the barriers inside a decode, and never compute at the same time: each
llama.cpp computation (a ``llama_decode`` of inference, an embedding batch) holds the ``CoreLease``, a file
lock in the stack's run directory (shared by every container of the compose stack). The figures behind the
choice (a decode beside an embedding process, two decoding processes, under each wait policy) are in
docs/benchmarks.md, "Sharing the cores" (``scripts/bench/core_sharing.py``).

A computation waits for the lease at most ``runtime.core_lease_wait_s`` (30 s; one decode step or embedding
batch holds it for seconds at most), logging the holder's pid every 5 s, then raises ``LeaseTimeout``: a
``busy`` error for the requests that needed the cores, so a holder that hangs (stopped, or stuck in a native
call) costs requests an error and never leaves a service waiting for ever. ``flock`` cannot wait with a
deadline, so a waiter tries again every millisecond: a hand-over costs about 0.6 ms more than a blocking wait
(two processes taking 20 ms turns, this box).
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import structlog

from shared.config import Config
from shared.protocol import ErrorCode, ProtocolError
from shared.security import SecurityError, private_dir

#: Spins before an OpenMP thread sleeps: enough for a decode's barriers (libgomp: roughly 0.3 ms), safe under the lease.
LEASED_SPIN_COUNT = "30000"
#: For llama.cpp that computes without the lease (the test suite's in-process models): sleep soon.
UNLEASED_SPIN_COUNT = "1000"
#: How often a waiter tries the lease again.
_RETRY_S = 0.001
#: A wait this long is logged with the holder's pid, and again each time as long.
_LOG_EVERY_S = 5.0

_log = structlog.get_logger()


def share_cores_with_openmp(spin_count: str = LEASED_SPIN_COUNT) -> None:
    """Set the OpenMP wait policy; call before ``llama_cpp`` loads libgomp (it reads them once).

    Values already in the environment win, and so does what a parent process set: the services a test
    starts inherit the tests' shorter spin."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", spin_count)


def _open_lock(path: Path) -> int:
    """A lock file of ours: never followed through a symlink, refused when another uid owns it (its owner
    could hold the lease for ever)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as exc:
        raise SecurityError(f"cannot open the core lease {path} ({exc.strerror}); is it a symlink?") from exc
    owner = os.fstat(fd).st_uid
    if owner != os.geteuid():
        os.close(fd)
        raise SecurityError(f"the core lease {path} is owned by uid {owner}, not by us; remove it")
    return fd


class LeaseTimeout(ProtocolError):
    """The cores were not free within the wait: the computation that needed them did not run, and its requests
    fail ``busy`` (retry later) while the service goes on."""


class CoreLease:
    """Held around each llama.cpp computation, so that two processes never compute on the cores at once.

    A ``flock`` on one file of the run directory: the kernel releases it when its holder dies, so a crashed
    service never leaves it taken. Alone, a lock lets a process that computes in a tight loop take it back
    before a woken waiter runs (an embedding ingest starved the decode to 3 tok/s in some runs), so the
    lease is handed over in turns: a process waits for it while holding a second lock, the queue, which a
    holder must take before it may wait again. A thread lock in front makes it exclusive between this
    process's threads too (``flock`` is per open file, not per thread). The holder writes its pid into the
    lock file, so a waiter can say whom it waits for."""

    def __init__(self, path: Path, wait_s: float = 30.0):
        self.path = path
        self.wait_s = wait_s
        self._fd = _open_lock(path)
        self._queue_fd = _open_lock(path.with_name(path.name + ".queue"))
        self._threads = threading.Lock()

    def __enter__(self) -> CoreLease:
        deadline = time.monotonic() + self.wait_s
        if not self._threads.acquire(timeout=self.wait_s):
            raise self._timeout()
        try:
            self._take(self._queue_fd, deadline)
            try:
                self._take(self._fd, deadline)
            finally:
                fcntl.flock(self._queue_fd, fcntl.LOCK_UN)
            os.pwrite(self._fd, f"{os.getpid():<10}\n".encode(), 0)
        except BaseException:
            self._threads.release()
            raise
        return self

    def _take(self, fd: int, deadline: float) -> None:
        """Lock ``fd``, trying again every ``_RETRY_S`` until ``deadline``."""
        started = logged = deadline - self.wait_s
        while True:
            try:
                return fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            now = time.monotonic()
            if now >= deadline:
                raise self._timeout()
            if now - logged >= _LOG_EVERY_S:
                _log.warning("core_lease_waiting", holder_pid=self.holder(), waited_s=round(now - started, 1),
                             lease=str(self.path))
                logged = now
            time.sleep(_RETRY_S)

    def holder(self) -> int | None:
        """The pid of the process that holds the lease, or held it last (None before anyone did)."""
        text = os.pread(self._fd, 16, 0).strip()
        return int(text) if text.isdigit() else None

    def _timeout(self) -> LeaseTimeout:
        pid = self.holder()
        _log.warning("core_lease_timeout", holder_pid=pid, wait_s=self.wait_s, lease=str(self.path))
        return LeaseTimeout(ErrorCode.BUSY, f"the cores were not free within {self.wait_s:g} s "
                                            f"(runtime.core_lease_wait_s): process {pid} holds {self.path}; "
                                            "retry later")

    def __exit__(self, *exc_info) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._threads.release()

    def close(self) -> None:
        os.close(self._fd)
        os.close(self._queue_fd)


def stack_lease(config: Config) -> CoreLease:
    """The lease that every service of ``config``'s stack takes."""
    return CoreLease(private_dir(config.runtime.run_dir()) / "cores.lock", config.runtime.core_lease_wait_s)
