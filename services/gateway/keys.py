"""API keys of the HTTP gateway: made by ``scripts/ops/keys api-key NAME``, checked on every request.

The file holds one ``NAME SHA256HEX`` line per key, never the key itself, so a
copy of the file (a backup, a volume snapshot) grants nothing. A presented key
is hashed and compared with every stored digest by ``hmac.compare_digest``
(constant time, no early exit), so the reply time says nothing about how much
of a key was right. The file is read again when it changes, so a key added or
revoked takes effect without a restart; a file that turns unreadable while the
gateway runs locks everyone out (fail closed) until it is fixed.

Once keys exist they stay required: revoking the last key leaves an empty file,
which admits no one (before, it turned authentication off), and a file that
disappears while the gateway runs keeps it locked until a restart. Turning keys
off is deliberate: delete the file and restart (loopback only).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from shared.config import Config

KEY_PREFIX = "mag-"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,31}$")


def keys_path(config: Config) -> Path:
    return config.gateway.api_keys_file or config.runtime.resolved_keys_dir() / "api_keys"


LOCAL_KEY_NAME = "local"


def local_key_path(config: Config) -> Path:
    """Where the key made at the first start is kept in clear, mode 0600, for the user's own clients."""
    return keys_path(config).with_name("local.key")


def ensure_local_key(config: Config) -> Path | None:
    """Keys on from the first start (as Jupyter's token): with no key file yet, make key ``local`` and keep it
    in ``local_key_path``; returns that path when it was made now, None when keys already existed."""
    if keys_path(config).exists():
        return None
    path = local_key_path(config)
    key = create_key(keys_path(config), LOCAL_KEY_NAME)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return path


def read_local_key(config: Config) -> str | None:
    """The first-start key, for clients on this box (None when the file is absent or not ours to read)."""
    try:
        return local_key_path(config).read_text().strip() or None
    except OSError:
        return None


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class _Entry:
    name: str
    digest: bytes


class ApiKeys:
    """The authorized keys of one file; ``who(key)`` names the key's owner or says None."""

    def __init__(self, path: Path):
        """Reads the file now: a malformed one raises ValueError (the gateway does not start)."""
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._entries: list[_Entry] = []
        self.broken: str | None = None  # why the file could not be read since it last changed
        self._existed = False  # the file was there at some point in this process's life
        self._current(strict=True)

    def _current(self, strict: bool = False) -> list[_Entry]:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp != self._stamp:
            self._stamp = stamp
            self._existed = self._existed or stamp is not None
            try:
                self._entries, self.broken = (_parse(self.path) if stamp else []), None
            except (OSError, ValueError) as err:
                if strict:
                    raise ValueError(str(err)) from None
                self._entries, self.broken = [], str(err)
        return self._entries

    def present(self) -> bool:
        """Keys are configured, or were (an emptied or vanished file), or the file is broken: every request
        must then carry a valid one."""
        self._current()
        return self._existed

    def names(self) -> list[str]:
        return [e.name for e in self._current()]

    def who(self, key: str) -> str | None:
        presented = _digest(key)
        owner = None
        for entry in self._current():  # every entry is compared: no early exit
            if hmac.compare_digest(presented, entry.digest):
                owner = entry.name
        return owner


def _parse(path: Path) -> list[_Entry]:
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2 or not NAME_PATTERN.match(parts[0]) or not re.fullmatch(r"[0-9a-f]{64}", parts[1]):
            raise ValueError(f"{path}:{number}: expected 'NAME SHA256HEX', got {line[:80]!r}")
        entries.append(_Entry(parts[0], bytes.fromhex(parts[1])))
    return entries


def create_key(path: Path, name: str) -> str:
    """A new key for ``name`` (replacing any earlier one of that name); returns the key, which is shown once."""
    if not NAME_PATTERN.match(name):
        raise ValueError(f"key name {name!r}: use 1-31 of A-Z a-z 0-9 _ . -")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    _write(path, [e for e in _read(path) if e.name != name] + [_Entry(name, _digest(key))])
    return key


def revoke_key(path: Path, name: str) -> bool:
    entries = _read(path)
    kept = [e for e in entries if e.name != name]
    _write(path, kept)
    return len(kept) < len(entries)


def _read(path: Path) -> list[_Entry]:
    return _parse(path) if path.exists() else []


def _write(path: Path, entries: list[_Entry]) -> None:
    """Replace the file atomically (a reader sees the old or the new list, never half of one), mode 0600."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# Magnitude gateway API keys: NAME SHA256(key). Made by scripts/ops/keys api-key NAME.\n")
        f.writelines(f"{e.name} {e.digest.hex()}\n" for e in entries)
    os.replace(tmp, path)
