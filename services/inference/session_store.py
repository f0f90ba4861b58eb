"""Sessions' KV on disk, so an agent's session survives a restart of the inference service.

On drain (SIGTERM from ``magnitude down``, a watchdog restart, the memory ceiling) every session's sequence is
written here, one file per session and model; a session that comes back after the restart is restored from it
on its next request (``kv_source: disk``), so that step again prefills only its new tokens.

A file is named by a hash of the model and the session id (ids are capabilities: never written in clear) and
is used only if its fingerprint (model file, KV layout, llama.cpp build) equals the running engine's and its
checksum holds; anything else is deleted and the session starts cold. The folder is bounded
(``engine.session_disk_mb``), least recently used files go first. A write goes to a temporary file, is fsynced
and renamed, so a crash mid-write leaves the previous file or none, never a torn one; the temporary file a dead
writer left is deleted at the next eviction (and when the store opens).

A file is read as untrusted bytes: a header field of the wrong type rejects the file like any damage.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import struct
import zlib
from pathlib import Path
from typing import Any

import structlog

from shared.process import is_alive

MAGIC = b"MAGKV\x01"
_LENGTH = struct.Struct("<I")
_TMP = ".tmp"


class SessionStore:
    def __init__(self, root: Path, fingerprint: dict[str, Any], budget_bytes: int):
        self.root = root
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self._key = json.dumps(fingerprint.get("model"), sort_keys=True)
        self.log = structlog.get_logger().bind(service="inference")
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._evict(keep=None)

    def path(self, session_id: str) -> Path:
        return self.root / (hashlib.sha256(f"{self._key}\0{session_id}".encode()).hexdigest()[:40] + ".kv")

    def has(self, session_id: str) -> bool:
        return self.path(session_id).is_file()

    def save(self, session_id: str, tokens: list[int], state: bytes) -> bool:
        """Write one session's KV (replacing an older file); False when it alone is over the budget."""
        packed = array.array("i", tokens).tobytes()
        header = json.dumps({"fingerprint": self.fingerprint, "n_tokens": len(tokens), "state_bytes": len(state),
                             "crc32": zlib.crc32(state, zlib.crc32(packed))}).encode()
        size = len(MAGIC) + _LENGTH.size + len(header) + len(packed) + len(state)
        if size > self.budget_bytes:
            return False
        path = self.path(session_id)
        tmp = path.with_suffix(f"{_TMP}{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header)
            f.write(packed)
            f.write(state)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._evict(keep=path)
        return True

    def load(self, session_id: str) -> tuple[list[int], bytes] | None:
        """The session's tokens and KV state, or None (no file; a mismatched or damaged one is deleted)."""
        path = self.path(session_id)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            tokens, state = self._parse(data)
        except ValueError as err:
            self.log.warning("session_file_rejected", file=path.name, reason=str(err))
            path.unlink(missing_ok=True)
            return None
        os.utime(path)  # recently used: evicted last
        return tokens, state

    def _parse(self, data: bytes) -> tuple[list[int], bytes]:
        if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _LENGTH.size:
            raise ValueError("not a session file")
        (n,) = _LENGTH.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _LENGTH.size
        try:
            header = json.loads(data[start:start + n])
            n_tokens, n_state, crc = header["n_tokens"], header["state_bytes"], header["crc32"]
        except (ValueError, KeyError, TypeError):
            raise ValueError("unreadable header") from None
        if not all(type(v) is int and v >= 0 for v in (n_tokens, n_state, crc)):
            raise ValueError("header fields are not counts")
        if header.get("fingerprint") != self.fingerprint:
            raise ValueError("saved by another model, KV layout or llama.cpp build")
        body = data[start + n:]
        if len(body) != 4 * n_tokens + n_state:
            raise ValueError("truncated")
        packed, state = body[:4 * n_tokens], body[4 * n_tokens:]
        if zlib.crc32(state, zlib.crc32(packed)) != crc:
            raise ValueError("checksum mismatch")
        return array.array("i", packed).tolist(), state

    def drop(self, session_id: str) -> bool:
        try:
            self.path(session_id).unlink()
            return True
        except FileNotFoundError:
            return False

    def _evict(self, keep: Path | None) -> None:
        """Delete temporary files of writers that died, then the least recently used files until the folder fits
        its budget."""
        for p in self.root.glob(f"*{_TMP}*"):
            writer = p.suffix.removeprefix(_TMP)
            if not (writer.isdigit() and is_alive(int(writer))):
                p.unlink(missing_ok=True)
        files = []
        for p in self.root.glob("*.kv"):
            try:
                files.append((p.stat().st_mtime_ns, p.stat().st_size, p))
            except FileNotFoundError:
                continue
        total = sum(size for _, size, _ in files)
        for _, size, p in sorted(files):
            if total <= self.budget_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                total -= size
