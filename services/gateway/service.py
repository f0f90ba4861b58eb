"""The gateway process: the runtime with two transports, its ZeroMQ router and its HTTP server.

Its health reaches the watchdog the way every service's does: the router answers
``health`` on ``ipc://.../gateway.sock``, so ``magnitude health``, the compose
healthcheck (``scripts/ops/health --service gateway``) and the watchdog's
heartbeat need nothing new, and the healthcheck stays light. What that answer
says about HTTP comes from the HTTP server's thread, which the runtime watches
like a worker: uvicorn's event loop beats about once a second. A loop blocked
for ``gateway.loop_stall_s``, or a server thread that died, reads ``ok: false``,
and the watchdog restarts the gateway as hung; a dead process is restarted as
dead, like any service.

The HTTP socket is bound before the runtime starts, so a taken port stops
the process at once with a clear message, and a bind beyond loopback without
API keys is refused (the gateway would otherwise serve anyone who can reach it).
SIGTERM stops intake and lets running requests, streams included, finish: every
HTTP request counts as unanswered until the last byte of its response, and the
runtime drains until none is (``runtime.drain_timeout_s`` at most).
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import uvicorn

from services.gateway.access import Gateway, RateLimit
from services.gateway.app import create_app
from services.gateway.header_deadline import header_deadline_protocol
from services.gateway.keys import LOCAL_KEY_NAME, ApiKeys, ensure_local_key, keys_path
from services.gateway.upstream import Upstreams
from shared.config import Config
from shared.security import SecurityError, is_loopback
from shared.service import Runtime, Transport
from shared.service.zmq_router import ZmqRouter


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (OSError when the address is taken or not ours)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle off (TCP_NODELAY) only on sockets that say TCP, and
    # with Nagle on, a keep-alive client waits out its delayed ACK (~40 ms) on every response.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    sock.set_inheritable(True)
    return sock


class HttpServer(Transport):
    """A uvicorn server on its bound socket, as a transport: its own event loop runs on a thread the runtime
    watches, and a request counts as unanswered until ``in_flight`` no longer counts it."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, in_flight: Callable[[], int]):
        self.server, self.socket, self._in_flight = server, sock, in_flight

    def loops(self) -> list[Callable[[], None]]:
        return [lambda: self.server.run(sockets=[self.socket])]

    def stop(self) -> None:
        self.server.should_exit = True  # uvicorn stops accepting and drains its open requests

    def unanswered(self) -> bool:
        return self._in_flight() > 0

    def close(self) -> None:
        self.socket.close()


class GatewayService(Runtime):
    name = "gateway"

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config)
        # Only health, metrics and cancel: every gateway request arrives over HTTP.
        router = ZmqRouter(self, endpoint or config.runtime.endpoint(self.name), handled=lambda: ())
        cfg = config.gateway
        loopback = is_loopback(f"tcp://{_url_host(cfg.host)}:{cfg.port}")
        keys = self._first_start_keys(config, loopback)
        if not loopback and not keys.present():
            raise SecurityError(f"gateway.host {cfg.host} is not loopback and {keys.path} holds no API key; "
                                "make one with scripts/ops/keys api-key NAME (or bind 127.0.0.1)")
        self._http_in_flight = 0  # HTTP requests being answered: they are not the workers' jobs
        http_socket = bind(cfg.host, cfg.port)
        self.url = f"http://{_url_host(cfg.host)}:{http_socket.getsockname()[1]}"
        self.gateway = Gateway(config, Upstreams(config), keys, loopback, self.metrics, self.log,
                               RateLimit(cfg.feedback_per_minute))
        server = uvicorn.Server(uvicorn.Config(
            create_app(self.gateway, self.beat, self._count_http), log_config=None, access_log=False,
            http=header_deadline_protocol(cfg.header_timeout_s), server_header=False,
            # uvicorn annotates an int, but only hands it to asyncio.timeout(), which takes seconds as a float
            timeout_graceful_shutdown=config.runtime.drain_timeout_s,  # type: ignore[arg-type]
            lifespan="on"))
        self.http = HttpServer(server, http_socket, in_flight=lambda: self._http_in_flight)
        self.transports += [router, self.http]

    def _first_start_keys(self, config: Config, loopback: bool) -> ApiKeys:
        """The API keys, made now on a loopback first start unless keyless loopback is the explicit choice
        (beyond loopback keys stay a deliberate step: scripts/ops/keys api-key NAME)."""
        if loopback and config.gateway.allow_keyless_loopback:
            self.log.warning("gateway_keyless", why="gateway.allow_keyless_loopback: every local account on "
                             "this box can call its tools until a key exists (scripts/ops/keys api-key NAME)")
        elif loopback:
            made = ensure_local_key(config)
            if made:
                self.log.warning("api_key_created", path=str(made), name=LOCAL_KEY_NAME,
                                 use="Authorization: Bearer $(cat PATH)")
        return ApiKeys(keys_path(config))

    def _count_http(self, n: int) -> None:
        self._http_in_flight = n

    def running(self) -> int:
        return self._http_in_flight

    def health_details(self) -> dict[str, Any]:
        return {"url": self.url, "auth": "api_keys" if self.gateway.auth_required() else "none (loopback)",
                "api_keys_error": self.gateway.keys.broken}

    def worker_stall_s(self) -> float:
        return self.config.gateway.loop_stall_s

    def serving(self) -> None:
        self.log.info("gateway_listening", url=self.url, auth=self.health_details()["auth"])
