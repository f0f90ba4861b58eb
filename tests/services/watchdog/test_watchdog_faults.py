"""Fault tests: the real stack as local processes under the real watchdog (`magnitude up`).

Each service in turn is killed with SIGKILL while a client loop has a request in
flight; the client must get a ServiceError (not hang), and the same loop must
succeed again against a new process that the watchdog started. Also: a frozen
(SIGSTOP) service is killed and restarted as hung, and a memory ceiling below a
service's RSS restarts it. One stack serves every test of this module.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared import process
from shared.health import probe
from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config, dump_config, parse_config
from tests.conftest import REPORT, make_config, require_model, wait_for
from tests.magnitude.test_launcher import magnitude

pytestmark = pytest.mark.model

CLIENT_TIMEOUT_S = 3.0  # a request of the loop below takes well under a second here
RECOVERY_S = 60.0
WATCHDOG = {"backend": "local", "interval_s": 0.5, "health_timeout_s": 1.0, "hung_checks": 5, "backoff_reset_s": 5}

#: One cheap request per service, what a client loop against it sends.
REQUESTS = {
    "inference": ("generate", {"prompt": "The robot drove to the", "max_tokens": 8, "temperature": 0}),
    "embedding": ("embed", {"texts": ["where are the spare keys?"]}),
    "retrieval": ("memory.stats", {}),
    "tools": ("tool.call", {"tool": "calculator", "args": {"expression": "23 * 47"}}),
    "optimizer": ("feedback.stats", {}),
    "gateway": ("metrics", {}),  # its work is HTTP; over ZeroMQ it answers health and metrics
}


def write(home, config: Config, name: str):
    path = home / name
    path.write_text(dump_config(config))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require_model()
    home = tmp_path_factory.mktemp("wd", numbered=True)
    data = make_config(home, n_ctx=512).model_dump(mode="json")
    config = parse_config({**data, "watchdog": {**data["watchdog"], **WATCHDOG}})
    path = write(home, config, "stack.yaml")
    try:
        up = magnitude(path, "up")  # a child process: the services are not our children
        assert up.returncode == 0, up.stdout + up.stderr
        yield config, path, home
    finally:
        down = magnitude(path, "down")
        assert down.returncode == 0, down.stdout + down.stderr


def watchdog_status(config: Config) -> dict:
    with Client.for_service(WATCHDOG_NAME, config, timeout_s=5) as client:
        return client.request("watchdog.status")["services"]



def healthy_pid(config: Config, name: str) -> int | None:
    status = probe(config, name, timeout_s=1.0)
    return status.detail["pid"] if status.healthy else None


class ClientLoop(threading.Thread):
    """Sends one service's request over and over, recording (sent, done, error code or None) per call."""

    def __init__(self, config: Config, name: str):
        super().__init__(daemon=True)
        self.client = Client.for_service(name, config, timeout_s=CLIENT_TIMEOUT_S)
        self.msg_type, self.body = REQUESTS[name]
        self.results: list[tuple[float, float, str | None]] = []
        self.in_flight_since: float | None = None
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            sent = self.in_flight_since = time.monotonic()
            try:
                self.client.request(self.msg_type, self.body)
                code = None
            except ServiceError as err:
                code = err.code
            self.in_flight_since = None
            self.results.append((sent, time.monotonic(), code))
            if code:
                time.sleep(0.1)
        self.client.close()

    def succeeded_after(self, t: float) -> bool:
        return any(code is None and sent > t for sent, _, code in self.results)

    def kill_mid_request(self, pid: int) -> float:
        """SIGKILL ``pid`` while a request of this loop is inside it; returns when that request was sent.

        A request counts as inside once it is still unanswered 0.3 s after the process was frozen
        (SIGSTOP); otherwise the process is thawed and the next request is tried.
        """
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sent = self.in_flight_since
            if sent is None:
                time.sleep(0.0005)
                continue
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.3)
            if self.in_flight_since == sent:
                os.kill(pid, signal.SIGKILL)
                return sent
            os.kill(pid, signal.SIGCONT)
        raise AssertionError("never caught a request in flight")


def restarts_counted(config: Config, service: str, reason: str) -> float:
    """The watchdog's magnitude_restarts_total for one service and reason, read from its metrics."""
    with Client.for_service(WATCHDOG_NAME, config, timeout_s=5) as client:
        text = client.request("metrics")["text"]
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "magnitude_restarts_total"
               and sample.labels == {"service": service, "reason": reason})


@pytest.mark.parametrize("name", SERVICE_NAMES)
def test_kill_9_under_a_client_loop_is_survived(stack, name):
    config, _, _ = stack
    old_pid = wait_for(lambda: healthy_pid(config, name), RECOVERY_S, f"{name} healthy")
    restarts_before = watchdog_status(config)[name]["restarts"]
    loop = ClientLoop(config, name)
    loop.start()
    try:
        wait_for(lambda: loop.succeeded_after(0), 30, f"a first {name} request succeeds")
        in_flight_sent = loop.kill_mid_request(old_pid)
        killed_at = time.monotonic()
        new_pid = wait_for(lambda: (pid := healthy_pid(config, name)) not in (None, old_pid) and pid,
                           RECOVERY_S, f"a new {name} process is healthy")
        restarted_s = time.monotonic() - killed_at
        wait_for(lambda: loop.succeeded_after(killed_at), RECOVERY_S, f"the {name} loop succeeds again")
        recovered_s = time.monotonic() - killed_at
    finally:
        loop.stopping.set()
        loop.join(CLIENT_TIMEOUT_S + 5)
    # The client notices the peer went away (socket monitor) and fails the in-flight call at once.
    [(_, answered, code)] = [r for r in loop.results if r[0] == in_flight_sent]
    assert code == "unavailable" and answered - killed_at < CLIENT_TIMEOUT_S, (code, answered - killed_at)
    failures = [code for sent, _, code in loop.results if code and sent >= in_flight_sent]
    assert set(failures) <= {"timeout", "unavailable"}, failures
    longest = max(done - sent for sent, done, _ in loop.results)
    assert longest < CLIENT_TIMEOUT_S + 2, f"a call took {longest:.1f}s: it hung"
    assert healthy_pid(config, name) == new_pid
    status = watchdog_status(config)[name]
    assert status["restarts"] == restarts_before + 1 and status["last_reason"] == "dead"
    assert status["pid"] == new_pid
    assert restarts_counted(config, name, "dead") >= 1
    REPORT.append(f"watchdog: kill -9 {name}: new process healthy after {restarted_s:.1f}s, the client loop "
                  f"succeeded again after {recovered_s:.1f}s (its in-flight call failed with 'unavailable' "
                  f"{answered - killed_at:.2f}s after the kill; {len(failures)} failed calls)")


def test_frozen_service_is_killed_as_hung_and_restarted(stack):
    config, _, _ = stack
    old_pid = wait_for(lambda: healthy_pid(config, "tools"), RECOVERY_S, "tools healthy")
    restarts_before = watchdog_status(config)["tools"]["restarts"]
    os.kill(old_pid, signal.SIGSTOP)  # alive, but answers nothing: hung
    stopped_at = time.monotonic()
    try:
        status = wait_for(lambda: (s := watchdog_status(config)["tools"])["restarts"] > restarts_before and s,
                          RECOVERY_S, "the watchdog restarts the frozen tools service")
    finally:
        if process.is_alive(old_pid):
            os.kill(old_pid, signal.SIGKILL)
    assert status["last_reason"] == "hung"
    assert not process.is_alive(old_pid)  # SIGKILLed by the watchdog
    new_pid = wait_for(lambda: healthy_pid(config, "tools"), RECOVERY_S, "tools healthy again")
    assert new_pid != old_pid
    REPORT.append(f"watchdog: frozen tools service restarted as hung after {time.monotonic() - stopped_at:.1f}s")


def test_memory_ceiling_below_rss_restarts_the_service(stack):
    """A second watchdog, with a 1 MB ceiling for the optimizer, replaces the stack's own."""
    config, path, home = stack
    low = config.model_copy(deep=True)
    low.watchdog.service_memory_ceiling_mb = {"optimizer": 1}
    low_path = write(home, low, "low-ceiling.yaml")
    old_pid = wait_for(lambda: healthy_pid(config, "optimizer"), RECOVERY_S, "optimizer healthy")
    assert process.stop(config, WATCHDOG_NAME).startswith("stopped")
    process.spawn(low, WATCHDOG_NAME, str(low_path))
    try:
        status = wait_for(lambda: (s := _status_or_none(low)) and s["optimizer"]["restarts"] >= 1 and s,
                          RECOVERY_S, "a restart for memory")
        assert status["optimizer"]["last_reason"] == "memory"
        assert all(status[n]["restarts"] == 0 for n in SERVICE_NAMES if n != "optimizer")
        new_pid = wait_for(lambda: healthy_pid(config, "optimizer"), RECOVERY_S, "optimizer healthy again")
        assert new_pid != old_pid
    finally:
        process.stop(config, WATCHDOG_NAME)
    log = process.log_file(config, WATCHDOG_NAME).read_text()
    assert '"event": "memory_ceiling_exceeded"' in log and '"reason": "memory"' in log


def _status_or_none(config: Config) -> dict | None:
    try:
        return watchdog_status(config)
    except ServiceError:
        return None  # still starting
