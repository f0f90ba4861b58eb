"""The inference worker dies -> health reads unhealthy -> the real watchdog restarts inference.

The first process is the real service with one injected fault (``tests/fragile_inference.py``: its scheduler
loop raises on a marked request); the watchdog's own supervisor and local backend notice and restart
``services.inference``, the real module.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import structlog

from shared import process
from shared.client import Client, ServiceError
from shared.config import parse_config
from shared.health import probe
from services.watchdog.backends import LocalBackend
from services.watchdog.supervisor import Supervisor
from tests.conftest import REPO, make_config, require_model, wait_for, write_config
from tests.fragile_inference import DIE

pytestmark = pytest.mark.model


def test_a_dead_scheduler_loop_reads_unhealthy_and_the_watchdog_restarts_inference(tmp_path):
    require_model()
    data = make_config(tmp_path, n_ctx=512).model_dump(mode="json")
    config = parse_config({**data, "watchdog": {**data["watchdog"], "backend": "local", "hung_checks": 2,
                                                 "inference_nice": 0, "pin_inference": False}})
    path = write_config(tmp_path, config)
    fragile = subprocess.Popen([sys.executable, "-m", "tests.fragile_inference", "--config", str(path)],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / "fragile.log", "ab"),
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
    process.pid_file(config, "inference").parent.mkdir(parents=True, exist_ok=True)
    process.pid_file(config, "inference").write_text(str(fragile.pid))
    supervisor = Supervisor(config, LocalBackend(config, str(path)), structlog.get_logger())
    state = supervisor.states["inference"]
    try:
        wait_for(lambda: probe(config, "inference", timeout_s=1).healthy, 60, "the stand-in is healthy")
        supervisor.check("inference", state)
        assert state.state == "healthy" and state.pid == fragile.pid

        with Client.for_service("inference", config, timeout_s=2) as client:
            with pytest.raises(ServiceError):  # its request is lost with the loop: no reply ever comes
                client.generate(DIE, max_tokens=1)
        sick = wait_for(lambda: (s := probe(config, "inference", timeout_s=1)).detail.get("ok") is False and s,
                        10, "health to read unhealthy")
        # the scheduler's thread is dead; the preparing workers live on, but health judges by every worker
        assert sick.detail["workers_alive"] == sick.detail["workers"] - 1 and sick.detail["pid"] == fragile.pid

        wait_for(lambda: supervisor.check("inference", state) or state.restarts, 30, "the watchdog to restart it")
        assert state.last_reason == "hung"
        # SIGKILLed, since a hung process cannot drain: gone without the log line a drain ends with. (Its exit
        # code is not to be had: the watchdog's backend reaps the children it restarts, this one included.)
        wait_for(lambda: not process.is_alive(fragile.pid), 10, "the hung process to be gone")
        assert "service_stopping" not in (tmp_path / "fragile.log").read_text()
        new_pid = wait_for(lambda: (s := probe(config, "inference", timeout_s=1)).healthy and s.detail["pid"],
                           60, "the real service is healthy again")
        assert new_pid != fragile.pid
        with Client.for_service("inference", config, timeout_s=60) as client:
            assert client.generate("The robot drove to the", max_tokens=4, temperature=0).stats.completion_tokens
    finally:
        process.stop(config, "inference")
        if fragile.poll() is None:
            fragile.kill()
            fragile.wait()
    assert '"event": "worker_died"' in (tmp_path / "fragile.log").read_text()
