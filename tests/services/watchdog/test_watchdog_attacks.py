"""A dead worker that still read healthy (issue 16): the watchdog sees it and restarts the service."""

from __future__ import annotations

import pytest

from services.watchdog.supervisor import Supervisor
from shared.client import Client, ServiceError
from shared.logs import configure_logging
from tests.conftest import ServiceProcess, make_config, wait_for, write_config

pytestmark = pytest.mark.security


class _FragileBackend:
    """The watchdog's view of one stand-in tools process (tests.fragile_service); the others are absent."""

    kind = "test"
    replaces_exited = False

    def __init__(self, svc: ServiceProcess):
        self.svc, self.restarted = svc, []

    def pid(self, name: str) -> int | None:
        return self.svc.proc.pid if name == "tools" and self.svc.proc.poll() is None else None

    def memory_mb(self, name: str) -> float | None:
        return None

    def start(self, name: str) -> None:
        pass  # the other services are not part of this test

    def restart(self, name: str, hard: bool) -> None:
        self.restarted.append((name, hard))
        self.svc.proc.kill()
        self.svc.proc.wait()
        self.svc.start()

    def set_nice(self, name: str, nice: int) -> None:
        pass

    def pin(self, name: str, cpus: set[int]) -> None:
        pass


def test_a_killed_worker_reads_unhealthy_and_the_watchdog_restarts_the_service(tmp_path):
    config = make_config(tmp_path)
    config.watchdog.hung_checks = 2
    svc = ServiceProcess("tools", write_config(tmp_path, config), config, module="tests.fragile_service").start()
    backend = _FragileBackend(svc)
    supervisor = Supervisor(config, backend, configure_logging("watchdog", "warning"))
    try:
        supervisor.tick()
        assert supervisor.states["tools"].state == "healthy"
        first_pid = svc.proc.pid
        with Client(svc.endpoint, timeout_s=1) as client:
            with pytest.raises(ServiceError):
                client.request("tool.list")  # kills the only worker; its request is lost with it
            wait_for(lambda: not client.health()["ok"], 5, "health to turn unhealthy")
        for _ in range(config.watchdog.hung_checks):
            supervisor.tick()
        assert supervisor.states["tools"].last_reason == "hung" and backend.restarted == [("tools", True)]
        assert svc.proc.pid != first_pid
        with Client(svc.endpoint, timeout_s=5) as client:
            assert client.health()["ok"]
    finally:
        svc.stop()
