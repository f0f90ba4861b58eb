"""compose.yaml must name only things that exist: service packages, scripts, volumes, config."""

import os
import json
import shutil
import subprocess

import pytest
import yaml

from magnitude.cli import build_parser
from shared.config import SERVICE_NAMES, load_config
from tests.conftest import REPO

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
        elif svc["command"][:2] == ["magnitude", "models"]:  # a setup job pulling from the model catalog
            args = build_parser().parse_args(svc["command"][1:])
            assert args.models_command == "pull", f"{name}: {svc['command']}"
        else:  # a setup job: docker/with-packages PIP_ARGS -- python -m scripts.JOB.NAME ...
            files = [arg for arg in svc["command"] if arg.startswith(("docker/", "scripts/"))]
            files += [arg.replace(".", "/") + ".py" for arg in svc["command"] if arg.startswith("scripts.")]
            assert files and all((REPO / f).is_file() for f in files), f"{name}: {svc['command']}"


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
            source, target = mount.removesuffix(":ro").rsplit(":", 1)
            if source.startswith("/"):  # the docker socket, for the watchdog only
                assert (name, source) == ("watchdog", "/var/run/docker.sock"), mount
            elif target == "/wheelhouse":  # read-only, for the setup jobs that install model packages
                assert service_module(svc["command"]) is None and mount.endswith(":ro"), mount
                assert source == "${MAGNITUDE_WHEELHOUSE:-./wheelhouse}" and (REPO / "wheelhouse").is_dir()
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


def test_only_the_watchdog_gets_docker_and_it_is_told_so():
    for name, svc in COMPOSE["services"].items():
        if name == "watchdog":
            # root only until docker/entrypoint has added the socket's group and dropped to magnitude
            assert svc["user"] == "root" and svc["environment"]["MAGNITUDE_WATCHDOG_BACKEND"] == "docker"
            assert "setpriv --reuid=magnitude" in (REPO / "docker" / "entrypoint").read_text()
        else:
            assert "user" not in svc, name  # the image's user: magnitude
            assert "MAGNITUDE_WATCHDOG_BACKEND" not in svc.get("environment", {}), name


def test_the_watchdog_depends_on_every_service_so_down_stops_it_first():
    # compose stops in reverse dependency order: a watchdog still running while a service stops would
    # restart it, and `down` then fails on the network that container still holds.
    supervised = {name for name, svc in COMPOSE["services"].items()
                  if service_module(svc["command"]) and name != "watchdog"}
    assert supervised <= set(COMPOSE["services"]["watchdog"]["depends_on"])


def test_the_mcp_example_adds_a_server_container_the_tools_service_reaches_over_http_with_a_key():
    overlay = yaml.safe_load((REPO / "examples" / "mcp" / "compose.yaml").read_text())
    robot, tools = overlay["services"]["home-robot"], overlay["services"]["tools"]
    assert "ports" not in robot and robot["command"][:2] == ["python", "/opt/home-robot/home_robot.py"]
    assert "./examples/mcp:/opt/home-robot:ro" in robot["volumes"] and "HOME_ROBOT_KEY" in robot["environment"]["MCP_KEY"]
    source, target = tools["volumes"][0].split(":")[:2]
    assert tools["environment"]["MAGNITUDE_CONFIG"] == target
    server = load_config(REPO / source).agent.mcp_servers[0]
    assert server.transport == "http" and server.url == "http://home-robot:8765/mcp"
    assert server.headers["Authorization"] == "Bearer ${HOME_ROBOT_KEY}"  # the key itself is in no file


@pytest.mark.skipif(not shutil.which("docker-compose"), reason="docker-compose not installed (CI installs it)")
def test_docker_compose_validates_the_mcp_example_on_top_of_the_stack():
    out = subprocess.run(["docker-compose", "-f", str(REPO / "compose.yaml"), "-f",
                          str(REPO / "examples" / "mcp" / "compose.yaml"), "config", "-q"],
                         capture_output=True, text=True, cwd=REPO, env={**os.environ, "HOME_ROBOT_KEY": "k"})
    assert out.returncode == 0, out.stderr


def test_the_tools_container_sandboxes_and_sees_only_the_run_volume():
    """Issue 23, finding 2: a seccomp profile of the repo lets bwrap create namespaces, in that container only
    (no privileged, no unconfined profile); the config refuses to run tools bare; no data or models volume."""
    tools = COMPOSE["services"]["tools"]
    assert tools["volumes"] == ["run:/run/magnitude"]
    assert tools["security_opt"] == ["seccomp=docker/seccomp-tools.json"] and not tools.get("privileged")
    profile = json.loads((REPO / "docker" / "seccomp-tools.json").read_text())
    refused = {name for rule in profile["syscalls"] if rule["action"] == "SCMP_ACT_ERRNO" for name in rule["names"]}
    assert not refused & {"unshare", "clone", "mount", "umount2", "pivot_root"}  # what bwrap needs
    assert {"bpf", "keyctl", "open_by_handle_at", "ptrace", "userfaultfd", "kexec_load"} <= refused
    for name, svc in COMPOSE["services"].items():
        assert name == "tools" or "security_opt" not in svc, name
    assert yaml.safe_load((REPO / "docker" / "magnitude.yaml").read_text())["agent"]["tool_isolation"] == "bubblewrap"
