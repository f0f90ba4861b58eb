"""The ``runtime`` and ``metrics`` sections: where sockets, data and logs live; limits; the /metrics endpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from shared.config.base import SERVICE_NAMES, WATCHDOG_NAME, Section, magnitude_home, require_known_services

IPC = "ipc://"
#: Linux abstract sockets (``ipc://@name``) have no file, so no permissions: any local account can connect.
ABSTRACT_IPC = IPC + "@"
_EXIT_MARGIN_S = 15.0


def ipc_path(endpoint: str) -> Path | None:
    """The socket file of an ``ipc://`` endpoint; None for other transports and abstract sockets."""
    return Path(endpoint[len(IPC):]) if endpoint.startswith(IPC) and not endpoint.startswith(ABSTRACT_IPC) else None


class RuntimeConfig(Section):
    runtime_dir: Path | None = Field(None, description="ipc sockets and pid files; default MAGNITUDE_HOME/run")
    data_dir: Path | None = Field(None, description="databases and strategy; default MAGNITUDE_HOME/data")
    endpoints: dict[str, str] = Field(default_factory=dict, description="per-service override, e.g. tcp://127.0.0.1:5555")
    max_frame_bytes: int = Field(1 << 20, ge=1024, le=1 << 30)
    queue_size: int = Field(32, ge=1, le=100000, description="requests waiting per service before 'busy'")
    max_generations_per_client: int = Field(16, ge=1, le=100000, description="generations one client (API key, "
                                            "CURVE identity, else connection) may have in flight before 'busy'")
    worker_stall_s: float = Field(120.0, gt=0, le=86400, description="a worker thread silent this long reads "
                                  "unhealthy, so the watchdog restarts its service (tools: at least the longest "
                                  "tool timeout)")
    drain_timeout_s: float = Field(60.0, gt=0, le=3600, description="on SIGTERM a service finishes what it "
                                   "accepted (inference: and saves its sessions) for at most this long")
    core_lease_wait_s: float = Field(30.0, gt=0, le=3600, description="a llama.cpp computation waits this long "
                                     "for the cores (shared/cores.py) while another process holds them, then "
                                     "fails its request 'busy' naming the holder's pid; keep it under "
                                     "worker_stall_s")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_max_bytes: int = Field(10 << 20, ge=4096, le=1 << 40, description="a service's log file (run_dir/NAME.log) "
                               "past this is renamed NAME.log.1 and a new one started")
    log_backups: int = Field(3, ge=0, le=100, description="rotated log files kept per service (NAME.log.1 is the "
                             "newest); older ones are deleted")
    curve: bool = Field(False, description="require CURVE auth on every tcp endpoint, loopback too "
                                           "(always required beyond loopback)")
    keys_dir: Path | None = Field(None, description="CURVE keys from scripts/ops/keys; default data_dir/keys")
    client_key: str = Field("local", pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                            description="name of the client key this machine's tools use")

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_zmq(cls, v: dict[str, str]) -> dict[str, str]:
        require_known_services(v, (*SERVICE_NAMES, WATCHDOG_NAME))
        for name, url in v.items():
            if not url.startswith(("ipc://", "tcp://")):
                raise ValueError(f"{name}: endpoint must start with ipc:// or tcp://, got {url!r}")
            if url.startswith(ABSTRACT_IPC):
                raise ValueError(f"{name}: {url!r} is an abstract socket, which any local account can reach; "
                                 "use a path (ipc:///run/...) in a private directory")
        return v

    def run_dir(self) -> Path:
        return self.runtime_dir or magnitude_home() / "run"

    def resolved_data_dir(self) -> Path:
        return self.data_dir or magnitude_home() / "data"

    def endpoint(self, service: str) -> str:
        return self.endpoints.get(service) or f"{IPC}{self.run_dir() / service}.sock"

    def resolved_keys_dir(self) -> Path:
        return self.keys_dir or self.resolved_data_dir() / "keys"

    def stop_timeout_s(self) -> float:
        """How long a stopper waits after SIGTERM before SIGKILL: the drain, plus the exit after it
        (compose.yaml's stop_grace_period must be at least this; tests/system/test_compose.py checks)."""
        return self.drain_timeout_s + _EXIT_MARGIN_S



class MetricsConfig(Section):
    """Each service's Prometheus text endpoint (the ``metrics`` message works whatever this says)."""

    enabled: bool = Field(True, description="serve /metrics over HTTP from every service")
    host: str = Field("127.0.0.1", min_length=1,
                      description="address the HTTP endpoints bind; they have no auth, so keep it loopback "
                                  "unless the network is private")
    allowed_hosts: list[Annotated[str, Field(min_length=1, max_length=253)]] = Field(
        default_factory=list, description="names a scrape's Host header may carry besides localhost, 127.0.0.1, "
                                          "::1 and metrics.host; others answer 400 (a web page re-pointing its "
                                          "own name at this box by DNS rebinding still sends its own); '*' allows any")
    base_port: int = Field(9464, ge=0, le=65536 - len(SERVICE_NAMES),
                           description="service i in SERVICE_NAMES order gets base_port + i; "
                                       "0 = an ephemeral port each (health's metrics_url says which)")
    ports: dict[str, Annotated[int, Field(ge=0, le=65535)]] = Field(
        default_factory=dict, description="per-service override, e.g. {inference: 9100}; 0 = ephemeral")

    @field_validator("ports")
    @classmethod
    def _ports_are_for_services(cls, v: dict[str, int]) -> dict[str, int]:
        require_known_services(v, (*SERVICE_NAMES, WATCHDOG_NAME))
        return v

    def port(self, service: str) -> int:
        if service in self.ports:
            return self.ports[service]
        if self.base_port == 0 or service not in SERVICE_NAMES:
            return 0
        return self.base_port + SERVICE_NAMES.index(service)


