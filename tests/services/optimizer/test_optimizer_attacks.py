"""Telemetry from a hostile sender (issue 16): one bad sample, made-up service names."""

from __future__ import annotations

import pytest

from shared.client import Client, ServiceError
from tests.conftest import ServiceProcess, make_config, wait_for, write_config

pytestmark = pytest.mark.security


def test_a_bad_telemetry_sample_is_rejected_alone(tmp_path):
    config = make_config(tmp_path)
    svc = ServiceProcess("optimizer", write_config(tmp_path, config), config).start()
    try:
        good = {"type": "tool.call", "latency_s": 0.02, "queue_wait_s": 0.0, "ok": True, "code": None}
        with Client(svc.endpoint, timeout_s=10) as client:
            reply = client.request("telemetry", {
                "service": "tools", "pid": 4242,
                "samples": [good, {**good, "latency_s": "fast"}, "not a map", {**good, "latency_s": float("inf")}],
                "system": {"rss_mb": 12.5, "cpu_percent": 1.0, "queue_depth": 0, "telemetry_dropped": 0}})
            assert reply["accepted"] == 2 and reply["rejected"] == 3, reply
            assert any("latency_s" in e for e in reply["errors"])
            # The good ones reached the optimizer, the system figures of the same batch included.
            wait_for(lambda: client.request("optimizer.status")["processes"].get("tools", {}).get("pid") == 4242,
                     5, "the batch's good samples ingested")
            for i in range(3):  # names a sender makes up never become keys of the optimizer's dicts
                with pytest.raises(ServiceError) as info:
                    client.request("telemetry", {"service": f"made-up-{i}", "samples": [good]})
                assert info.value.code == "bad_request"
            assert set(client.request("optimizer.status")["processes"]) == {"tools"}
            assert client.health()["ok"]
    finally:
        svc.stop()
