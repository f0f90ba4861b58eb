"""Who may connect: local by default, CURVE-authenticated beyond loopback.

ipc:// endpoints live in a 0700 directory, so only this user's processes reach
them; tcp:// on 127.0.0.0/8 or ::1 is local too. An endpoint bound to any
other address must use ZeroMQ CURVE: the service proves its identity with its
secret key and accepts only clients whose public key is in
``<keys_dir>/clients/``, checked by pyzmq's ZAP authenticator. Keys are made by
``scripts/keys``.

Layout of ``keys_dir``::

    server.key, server.key_secret        the services' keypair
    clients/<name>.key                   public keys of authorized clients
    client-<name>.key_secret             a client's own keypair (handed to that client)
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from shared.config import RuntimeConfig


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


@dataclass(frozen=True)
class Keypair:
    public: bytes
    secret: bytes


def _load(path: Path) -> Keypair:
    if not path.is_file():
        raise SecurityError(f"CURVE key {path} not found; create keys with scripts/keys")
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
            raise SecurityError(f"no authorized client keys in {clients}; add one with scripts/keys client NAME")
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


def create_keys(keys_dir: Path, client_names: list[str]) -> list[Path]:
    """Make the server keypair (once) and a keypair per client; return the files written."""
    keys_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (keys_dir / "clients").mkdir(exist_ok=True, mode=0o700)
    written = []
    if not (keys_dir / "server.key_secret").exists():
        written += [Path(p) for p in zmq.auth.create_certificates(str(keys_dir), "server")]
    for name in client_names:
        public, secret = zmq.auth.create_certificates(str(keys_dir), f"client-{name}")
        authorized = keys_dir / "clients" / f"{name}.key"
        authorized.write_bytes(Path(public).read_bytes())
        Path(public).unlink()
        written += [Path(secret), authorized]
    for path in written:
        path.chmod(0o600 if path.name.endswith("key_secret") else 0o644)
    return written
