"""Shared-memory buffers for payloads too big for a msgpack frame.

Ownership moves with the handle: the producer writes a segment and sends its
handle; the consumer reads it once with ``take_*`` and unlinks it. A producer
keeps a ``ShmPool`` of what it handed out and unlinks anything not taken within
a TTL (consumer died or never asked), and at start-up ``sweep_orphans`` unlinks
segments whose creating process is gone, so a crash leaks nothing past a restart.

Segment names are ``mag_<pid>_<hex>`` so the owner pid can be recovered; the
64 random bits make a name unguessable, and segments are created mode 0600.
A handle made for a session carries its id, and ``take_*`` refuses it to a
request of any other session (and leaves it for its owner).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

from shared.process import is_alive
from shared.protocol import ErrorCode, ProtocolError

PREFIX = "mag_"
_SHM_DIR = Path("/dev/shm")
#: Payloads above this many bytes are sent through shm instead of inline.
INLINE_LIMIT_BYTES = 256 * 1024
_MAX_SEGMENT_BYTES = 1 << 31


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Stop Python's resource tracker from unlinking a segment we hand to someone else."""
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - no public API on 3.11
    except Exception:
        pass


def _create(size: int) -> shared_memory.SharedMemory:
    name = f"{PREFIX}{os.getpid()}_{uuid.uuid4().hex[:16]}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    _untrack(shm)
    return shm


def _open(handle: Any, session: str | None) -> shared_memory.SharedMemory:
    if not isinstance(handle, dict) or not isinstance(handle.get("name"), str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle must be a map with a 'name'")
    if handle.get("session") is not None and handle["session"] != session:
        raise ProtocolError(ErrorCode.NOT_FOUND, "shm buffer belongs to another session")
    name = handle["name"]
    if not name.startswith(PREFIX) or "/" in name or len(name) > 64:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle names no Magnitude segment")
    size = handle.get("size")
    if not isinstance(size, int) or not 0 <= size <= _MAX_SEGMENT_BYTES:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle has no valid 'size'")
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        raise ProtocolError(ErrorCode.NOT_FOUND, f"shm buffer {name} does not exist (expired or already taken)")
    _untrack(shm)
    if shm.size < size:
        shm.close()
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"shm buffer {name} is smaller than its handle says")
    return shm


def put_bytes(data: bytes, pool: "ShmPool | None" = None, session: str | None = None) -> dict:
    """Copy ``data`` into a new segment and return its handle (bound to ``session`` if given)."""
    shm = _create(len(data))
    shm.buf[: len(data)] = data
    handle = {"name": shm.name, "size": len(data), "kind": "bytes", "session": session}
    shm.close()
    if pool is not None:
        pool.track(handle["name"])
    return handle


def _finish(shm: shared_memory.SharedMemory) -> None:
    shm.close()
    unlink(shm.name)  # not shm.unlink(): that would also notify the resource tracker we left


def take_bytes(handle: Any, session: str | None = None) -> bytes:
    """Read a bytes segment and unlink it: a handle can be taken once, by its own session."""
    shm = _open(handle, session)
    try:
        return bytes(shm.buf[: handle["size"]])
    finally:
        _finish(shm)


def unlink(name: str) -> bool:
    """Remove a segment by name; True if it existed."""
    try:
        os.unlink(_SHM_DIR / name)
        return True
    except FileNotFoundError:
        return False


def sweep_orphans() -> list[str]:
    """Unlink Magnitude segments whose creating process no longer exists."""
    removed = []
    if not _SHM_DIR.is_dir():
        return removed
    for path in _SHM_DIR.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX):].split("_", 1)[0])
        except ValueError:
            continue
        if not is_alive(pid) and unlink(path.name):
            removed.append(path.name)
    return removed


def list_segments() -> list[str]:
    return sorted(p.name for p in _SHM_DIR.glob(f"{PREFIX}*")) if _SHM_DIR.is_dir() else []


class ShmPool:
    """Segments a producer handed out and not yet seen taken; expired ones are unlinked."""

    def __init__(self, ttl_s: float = 60.0):
        self.ttl_s = ttl_s
        self._issued: dict[str, float] = {}
        self._lock = threading.Lock()

    def track(self, name: str) -> None:
        with self._lock:
            self._issued[name] = time.monotonic()

    def reap(self, now: float | None = None) -> int:
        """Unlink handed-out segments older than the TTL; return how many were still there."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [n for n, t in self._issued.items() if now - t > self.ttl_s]
            for name in expired:
                del self._issued[name]
        return sum(unlink(name) for name in expired)

    def close(self) -> int:
        """Unlink everything still outstanding (on shutdown)."""
        return self.reap(now=float("inf"))
