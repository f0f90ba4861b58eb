"""compose.yaml must name only things that exist: service packages, scripts, volumes, config."""

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shared.config import SERVICE_NAMES

REPO = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())


def service_module(command):
    return command[2] if command[:2] == ["python", "-m"] else None


def test_every_launcher_service_has_a_container_and_vice_versa():
    modules = {service_module(s.get("command", [])) for s in COMPOSE["services"].values()}
    assert {f"services.{n}" for n in SERVICE_NAMES} <= modules
    for name, svc in COMPOSE["services"].items():
        module = service_module(svc["command"])
        if module:
            assert (REPO / module.replace(".", "/") / "__main__.py").is_file(), name
        else:
            assert (REPO / svc["command"][1]).is_file(), f"{name}: {svc['command']}"


def test_healthchecks_call_the_health_script_for_their_own_service():
    for name, svc in COMPOSE["services"].items():
        if not service_module(svc["command"]):
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and (REPO / test[1]).is_file()
        assert test[2:] == ["--service", name]
        assert svc["restart"] in ("always", "unless-stopped", "on-failure")
        assert "mem_limit" in svc and "cpus" in svc


def test_volumes_are_declared_and_config_exists():
    declared = set(COMPOSE["volumes"])
    for name, svc in COMPOSE["services"].items():
        for mount in svc.get("volumes", []):
            source = mount.split(":")[0]
            if source.startswith("/"):  # the one host path: the docker socket, for the watchdog only
                assert (name, source) == ("watchdog", "/var/run/docker.sock"), mount
            else:
                assert source in declared
    assert (REPO / "Dockerfile").is_file()
    dockerfile = (REPO / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            for src in line.split()[1:-1]:
                assert (REPO / src).exists(), src


def test_shm_is_shared_between_services():
    owners = [n for n, s in COMPOSE["services"].items() if s.get("ipc") == "shareable"]
    assert owners == ["inference"]
    for name, svc in COMPOSE["services"].items():
        if service_module(svc["command"]) and name != "inference":
            assert svc.get("ipc") == "service:inference", name


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed (CI installs it)")
def test_docker_compose_validates_the_file():
    out = subprocess.run(["docker-compose", "-f", str(REPO / "compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
