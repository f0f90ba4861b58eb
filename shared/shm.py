"""Shared-memory buffers for payloads too big for a msgpack frame.

Ownership moves with the handle: the producer writes a segment and sends its
handle; the consumer reads it once with ``take_*`` and unlinks it. A producer
keeps a ``ShmPool`` of what it handed out and unlinks anything not taken within
a TTL (consumer died or never asked), and at start-up ``sweep_orphans`` unlinks
segments whose creating process is gone, so a crash leaks nothing past a restart.

Segment names are ``mag_<pid namespace>_<pid>_<hex>`` so the owner pid can be recovered, and
segments are created mode 0600. Containers share one /dev/shm with their own PID namespaces (compose's
``ipc: service:inference``, the Swarm stack's shm volume), where a pid means nothing: the sweep judges only
segments made in its own namespace. /dev/shm is world-writable, so the start-up sweep
touches only names in exactly that format and files owned by this uid, and a file
it cannot judge is skipped, never a reason to fail. Names are listable in /dev/shm, so a name is not
a capability: whoever creates a segment writes a header into it that records a
random 128-bit key and, when the segment is made for a session, that session
(its SHA-256). The handle carries the key; ``take_*`` opens a segment only when
the handle's key matches the header's and the request's session matches the
recorded one. A handle forged from a listed name, or claimed for another
session, is refused and the segment is left for its owner: a service can never
be made to read or unlink a buffer its caller was not given.

A taker says how much it will read (``max_bytes``): the segment's and the
header's sizes are checked before a payload byte is copied, and a bigger one is
a ``too_large`` error for that request (the segment is unlinked: its handle was
valid, so it was the caller's to give up).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import struct
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
#: What ``take_*`` reads at most unless its caller says otherwise.
MAX_TAKE_BYTES = 64 << 20
_MAX_SEGMENT_BYTES = 1 << 31
_NAME = re.compile(rf"^{PREFIX}[0-9]{{1,10}}_[0-9]{{1,10}}_[0-9a-f]{{16}}$")
_KEY = re.compile(r"^[0-9a-f]{32}$")
#: What the creator writes first: magic, key, bound-to-a-session flag, SHA-256 of the session, payload size.
_HEADER = struct.Struct("<4s16sB32sQ3x")
_MAGIC = b"MAG1"


def _untrack(shm: shared_memory.SharedMemory) -> None:
    """Stop Python's resource tracker from unlinking a segment we hand to someone else."""
    try:
        # No public API on 3.11; typeshed omits the private _name (the name with its leading slash, as registered)
        resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # noqa: SLF001
    except Exception:
        pass


def _pid_namespace() -> int:
    """This process's PID namespace (its inode), 0 where there is no /proc to say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


PID_NAMESPACE = _pid_namespace()


def segment_name(pid: int | None = None) -> str:
    """A new segment's name: this PID namespace, the creating pid (default ours), a random part."""
    return f"{PREFIX}{PID_NAMESPACE}_{os.getpid() if pid is None else pid}_{uuid.uuid4().hex[:16]}"


def _create(size: int) -> shared_memory.SharedMemory:
    name = segment_name()
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    _untrack(shm)
    return shm


def _session_digest(session_id: str | None) -> bytes:
    return hashlib.sha256((session_id or "").encode()).digest()


def _parse_handle(handle: Any) -> tuple[str, bytes]:
    """The segment name and key a handle claims (their shape only: the segment decides)."""
    if not isinstance(handle, dict) or not isinstance(handle.get("name"), str):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle must be a map with a 'name'")
    name, key = handle["name"], handle.get("key")
    if not _NAME.match(name):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle names no Magnitude segment")
    if not isinstance(key, str) or not _KEY.match(key):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle has no valid 'key' (32 hex digits)")
    size = handle.get("size")
    if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                             or not 0 <= size <= _MAX_SEGMENT_BYTES):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm handle has no valid 'size'")
    return name, bytes.fromhex(key)


def _open(handle: Any, session_id: str | None, max_bytes: int) -> tuple[shared_memory.SharedMemory, int]:
    """Open the segment a handle names if the handle's key and the caller's session match what its creator
    recorded and it holds at most ``max_bytes``; return it and its payload size."""
    name, key = _parse_handle(handle)
    missing = ProtocolError(ErrorCode.NOT_FOUND, f"shm buffer {name} does not exist (expired or already taken)")
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except (FileNotFoundError, PermissionError):  # another user's segment is as good as none
        raise missing from None
    _untrack(shm)
    try:
        if shm.size < _HEADER.size:
            raise missing
        magic, recorded_key, bound, digest, size = _HEADER.unpack_from(shm.buf)
        if magic != _MAGIC or not hmac.compare_digest(recorded_key, key):
            raise ProtocolError(ErrorCode.NOT_FOUND, f"shm handle does not match buffer {name} (forged or stale)")
        if bound and not hmac.compare_digest(digest, _session_digest(session_id)):
            raise ProtocolError(ErrorCode.NOT_FOUND, "shm buffer belongs to another session")
        if size > shm.size - _HEADER.size or handle.get("size", size) != size:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"shm buffer {name} is not the size its handle says")
    except ProtocolError:
        shm.close()
        raise
    if max(size, shm.size - _HEADER.size) > max_bytes:
        _finish(shm)
        raise ProtocolError(ErrorCode.TOO_LARGE, f"shm buffer {name} holds {size} bytes; this request takes at "
                                                 f"most {max_bytes}")
    return shm, size


def put_bytes(data: bytes, pool: "ShmPool | None" = None, session_id: str | None = None) -> dict:
    """Copy ``data`` into a new segment and return its handle; with ``session``, only that session may take it."""
    key = secrets.token_bytes(16)
    shm = _create(_HEADER.size + len(data))
    _HEADER.pack_into(shm.buf, 0, _MAGIC, key, session_id is not None, _session_digest(session_id), len(data))
    shm.buf[_HEADER.size: _HEADER.size + len(data)] = data
    handle: dict[str, Any] = {"name": shm.name, "size": len(data), "kind": "bytes", "key": key.hex()}
    shm.close()
    if pool is not None:
        pool.track(handle["name"])
    return handle


def _finish(shm: shared_memory.SharedMemory) -> None:
    shm.close()
    unlink(shm.name)  # not shm.unlink(): that would also notify the resource tracker we left


def take_bytes(handle: Any, session_id: str | None = None, max_bytes: int = MAX_TAKE_BYTES) -> bytes:
    """Read a bytes segment of at most ``max_bytes`` and unlink it: a handle can be taken once, by its own
    session."""
    shm, size = _open(handle, session_id, max_bytes)
    try:
        return bytes(shm.buf[_HEADER.size: _HEADER.size + size])
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
    """Unlink our uid's Magnitude segments, made in our PID namespace, whose creating process no longer exists.

    Anyone can create files in /dev/shm: a name not in our exact format, or a file of another uid, is not
    ours to judge, and one that vanishes or cannot be read while we look is skipped."""
    removed: list[str] = []
    if not _SHM_DIR.is_dir():
        return removed
    uid = os.geteuid()
    for path in _SHM_DIR.glob(f"{PREFIX}*"):
        if not _NAME.match(path.name):
            continue
        try:
            if path.lstat().st_uid != uid:
                continue
            namespace, pid = (int(part) for part in path.name[len(PREFIX):].split("_")[:2])
            if namespace == PID_NAMESPACE and not is_alive(pid) and unlink(path.name):
                removed.append(path.name)
        except OSError:
            continue
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
