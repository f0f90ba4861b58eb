"""health answers for the workers too: a dead worker thread reads unhealthy (the watchdog then restarts it)."""

from __future__ import annotations

import pytest

from shared.client import Client, ServiceError
from tests.conftest import ServiceProcess, make_config, wait_for, write_config


@pytest.fixture
def fragile(tmp_path):
    config = make_config(tmp_path)
    svc = ServiceProcess("tools", write_config(tmp_path, config), config, module="tests.fragile_service").start()
    yield svc
    svc.stop()


def test_dead_worker_makes_health_unhealthy(fragile):
    with Client(fragile.endpoint, timeout_s=2) as client:
        before = client.health()
        assert before["ok"] and before["workers"] == before["workers_alive"] == 1
        with pytest.raises(ServiceError):  # its request is lost with the worker (no reply ever comes)
            client.request("tool.list")
        after = wait_for(lambda: (h := client.health()) and not h["ok"] and h, 5, "health to turn unhealthy")
    assert after["workers_alive"] == 0 and not after["workers_ok"]
    assert '"event": "worker_died"' in fragile.log.read_text()


def test_healthy_idle_workers_keep_beating(tmp_path):
    config = make_config(tmp_path)
    config.runtime.worker_stall_s = 0.5  # idle workers beat every poll (0.2 s): never stale
    svc = ServiceProcess("tools", write_config(tmp_path, config), config, module="tests.fragile_service").start()
    try:
        with Client(svc.endpoint, timeout_s=2) as client:
            for _ in range(5):
                health = client.health()
                assert health["ok"] and health["worker_beat_age_s"] < 0.5
    finally:
        svc.stop()
