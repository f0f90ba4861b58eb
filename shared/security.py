"""Who may connect: local by default, CURVE-authenticated beyond loopback and for what changes the box.

ipc:// endpoints live in a 0700 directory, so only this user's processes reach
them; tcp:// on 127.0.0.0/8 or ::1 is local too. An endpoint bound to any
other address must use ZeroMQ CURVE: the service proves its identity with its
secret key and accepts only clients whose public key is in
``<keys_dir>/clients/``, checked by pyzmq's ZAP authenticator. Keys are made by
``scripts/ops/keys``.

Loopback is not a user: any local account can reach a loopback tcp port. So a
message that changes the box (``MessageSpec.privileged``: engine and model
control, strategy, tool calls, stored memories, feedback, telemetry) is served
on a tcp endpoint only when that endpoint authenticates its clients with CURVE
(``peers_authenticated``); over plain loopback tcp it answers ``unauthorized``.
So does a request that speaks for another client (``Field.privileged``: the
``owner`` a relaying gateway names), which would otherwise reach that client's KV
or dodge its own generation limit.

Secrets are written 0600 from the first byte (``os.open`` with that mode, no
chmod afterwards), their directories are kept 0700 (``private_dir`` tightens an
existing one, and refuses one that another account owns or can write), and a
secret key file readable by group or others is refused when loaded, as ssh
refuses such a private key.

HTTP endpoints on loopback answer only requests whose Host header names this
box (``allowed_host_names``): a web page that re-points its own name at
127.0.0.1 (DNS rebinding) still sends its own name. Session ids are
capabilities, so logs carry ``session_ref(id)``, never the id.

Layout of ``keys_dir``::

    server.key, server.key_secret        the services' keypair
    clients/<name>.key                   public keys of authorized clients
    client-<name>.key_secret             a client's own keypair (handed to that client)
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.config import RuntimeConfig, ipc_path


class SecurityError(RuntimeError):
    """A service that would be exposed without authentication refuses to start."""


def is_loopback(endpoint: str) -> bool:
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or '*': not provably local


def needs_curve(runtime: RuntimeConfig, endpoint: str) -> bool:
    return not is_loopback(endpoint) or (runtime.curve and endpoint.startswith("tcp://"))


def peers_authenticated(endpoint: str, curve: bool) -> bool:
    """Whether every peer of a bound endpoint is a known principal: ipc in a 0700 directory, inproc (this
    process), or a CURVE server (only keys in clients/ get through). An abstract ipc socket has no directory."""
    return curve or endpoint.startswith("inproc://") or ipc_path(endpoint) is not None


def private_dir(path: Path) -> Path:
    """Create ``path`` (and its missing parents) with mode 0700, or tighten it to 0700 if it exists and is ours.

    One that another account owns or can write is refused: its owner could read our sockets or hold our locks,
    and whoever could write in it may already have put files there (a key, a pid file, a database) that no
    chmod now takes out. Group-writable by our own group is no such account: umask 002 makes directories so
    where each user has a group of their own."""
    for missing in reversed([p for p in (path, *path.parents) if not p.exists()]):
        missing.mkdir(mode=0o700, exist_ok=True)  # mkdir(parents=True) would make the parents by the umask
    st = path.stat()
    if st.st_uid != os.geteuid():
        raise SecurityError(f"{path} is owned by uid {st.st_uid}, not by us (uid {os.geteuid()}); "
                            f"remove it or choose another directory")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and st.st_gid != os.getegid()):
        raise SecurityError(f"{path} is writable by other accounts (mode {mode:o}, group {st.st_gid}): they may "
                            f"have put files in it; check what it holds, then run: chmod 700 {path}")
    if mode & 0o077:
        path.chmod(0o700)
    return path


def session_ref(session_id: str | None) -> str | None:
    """What logs carry for a session id: the first 12 hex digits of its SHA-256. An id is a capability (whoever
    knows it reaches that session's KV), so it is never logged in clear; the same id always gives the same ref,
    so one session's lines can still be found in every service's log."""
    return None if session_id is None else hashlib.sha256(session_id.encode()).hexdigest()[:12]


#: Host names of this box that a web page elsewhere cannot make its own (DNS rebinding).
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
#: Bind-all addresses name no host (browsers reach 0.0.0.0 as this box).
ANY_ADDRESS = ("0.0.0.0", "::")


def allowed_host_names(bound_host: str, extra: Iterable[str] = ()) -> set[str]:
    """What the Host header of a request to an HTTP endpoint bound to ``bound_host`` may name: loopback's names,
    the bound address (unless it binds all), and ``extra`` (configured names; ``*`` allows any)."""
    return {name.lower() for name in (*LOOPBACK_NAMES, bound_host, *extra)} - set(ANY_ADDRESS)


def host_name(header: str) -> str | None:
    """The name a Host header carries ('[::1]:8000' -> '::1'); None when it is not a host[:port]."""
    try:
        return urlsplit(f"//{header}").hostname
    except ValueError:  # an unclosed IPv6 bracket
        return None


def host_allowed(header: str, allowed: set[str]) -> bool:
    """Whether a request whose Host header is ``header`` may be answered (see ``allowed_host_names``)."""
    return "*" in allowed or host_name(header) in allowed


def _check_private(path: Path) -> None:
    """A secret must be readable by its owner only."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SecurityError(f"{path} is readable by others (mode {mode:o}); run: chmod 600 {path}")


@dataclass(frozen=True)
class Keypair:
    public: bytes
    secret: bytes


def _load(path: Path) -> Keypair:
    if not path.is_file():
        raise SecurityError(f"CURVE key {path} not found; create keys with scripts/ops/keys")
    _check_private(path)
    public, secret = zmq.auth.load_certificate(str(path))
    if secret is None:
        raise SecurityError(f"{path} holds no secret key")
    return Keypair(public, secret)


def server_public_key(keys_dir: Path) -> bytes:
    public, _ = zmq.auth.load_certificate(str(keys_dir / "server.key"))
    return public


class CurveServer:
    """Turns a bound-to-be socket into a CURVE server, with a ZAP authenticator for clients/."""

    def __init__(self, ctx: zmq.Context, keys_dir: Path):
        self.keys = _load(keys_dir / "server.key_secret")
        clients = keys_dir / "clients"
        if not clients.is_dir() or not any(clients.glob("*.key")):
            raise SecurityError(f"no authorized client keys in {clients}; add one with scripts/ops/keys client NAME")
        if stat.S_IMODE(clients.stat().st_mode) & 0o022:  # whoever can add a key there could let anyone in
            raise SecurityError(f"{clients} is writable by others; run: chmod 700 {clients}")
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(clients))

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_secretkey = self.keys.secret
        sock.curve_publickey = self.keys.public
        sock.curve_server = True

    def stop(self) -> None:
        self._auth.stop()


def apply_curve_client(sock: zmq.Socket, keys_dir: Path, client_name: str) -> None:
    """Configure a client socket with its keypair and the server's public key."""
    keys = _load(keys_dir / f"client-{client_name}.key_secret")
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public_key(keys_dir)


def _write_certificate(path: Path, public: bytes, secret: bytes | None) -> Path:
    """A ZeroMQ certificate file (the format ``zmq.auth.load_certificate`` reads), created with its final
    mode: 0600 for a secret, 0644 for a public key. An existing file is replaced."""
    text = ("#   ZeroMQ CURVE " + ("**Secret** Certificate\n#   DO NOT PROVIDE THIS FILE TO OTHER USERS\n"
                                   if secret else "Public Certificate\n")
            + f'\nmetadata\ncurve\n    public-key = "{public.decode()}"\n'
            + (f'    secret-key = "{secret.decode()}"\n' if secret else ""))
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600 if secret else 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


def create_keys(keys_dir: Path, client_names: list[str]) -> list[Path]:
    """Make the server keypair (once) and a keypair per client; return the files written."""
    private_dir(keys_dir / "clients")
    private_dir(keys_dir)
    written = []
    if not (keys_dir / "server.key_secret").exists():
        public, secret = zmq.curve_keypair()
        written += [_write_certificate(keys_dir / "server.key", public, None),
                    _write_certificate(keys_dir / "server.key_secret", public, secret)]
    for name in client_names:
        public, secret = zmq.curve_keypair()
        written += [_write_certificate(keys_dir / f"client-{name}.key_secret", public, secret),
                    _write_certificate(keys_dir / "clients" / f"{name}.key", public, None)]
    return written
