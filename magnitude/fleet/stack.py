"""The Swarm stack, made from compose.yaml: one file to keep, the stack generated from it (docs/fleet.md).

``docker stack deploy`` does not run compose.yaml as it is: Swarm ignores ``build``, ``restart``, ``ipc``,
``shm_size`` and ``security_opt``, and refuses ``depends_on`` conditions and ``mem_limit``/``cpus``. So the
stack keeps each service's image, command, environment, volumes, healthcheck and logging, and says the rest the
way Swarm understands it:

- every service runs once on every node labelled ``magnitude.role=robot`` (``mode: global``): each robot's box
  runs its own stack, and the ``run`` volume's ipc sockets are per node, as the services that use them are;
- limits under ``deploy.resources``, restarts under ``deploy.restart_policy``; the setup jobs are ``global-job``
  services (once per node, retried on failure); there is no start order, so a service whose peer is not up yet
  fails its health check until it is;
- shared memory: Swarm has no ``ipc: service:...``, so every service mounts one tmpfs volume at /dev/shm; a
  named volume is per node, so the services of one node share it;
- the configuration is a Swarm config (the image's docker/magnitude.yaml plus where the API keys are) and the
  gateway's API keys a Swarm secret (``magnitude_api_keys``, made by the operator, see docs/fleet.md);
- the gateway's port is published in host mode, on each node itself: Swarm's routing mesh would send a robot's
  requests to another robot's box;
- the tools service gets no seccomp profile (a Swarm service cannot be given one through this engine's API), so
  bubblewrap cannot run there: the tools service refuses to start where python or shell tools are configured.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from shared.config.operations import WATCHDOG_BACKEND_ENV

#: What Swarm ignores or refuses (docker/cli's compose loader), dropped from every service.
SWARM_DROPS = ("build", "restart", "ipc", "shm_size", "security_opt", "depends_on", "mem_limit", "cpus",
               "container_name")
ROLE_LABEL = "magnitude.role"
API_KEYS_SECRET = "magnitude_api_keys"
CONFIG_NAME = "magnitude_config"
CONFIG_PATH = "/etc/magnitude/magnitude.yaml"
SERVICE_UID = "10001"  # the image's user magnitude (Dockerfile)
SHM_VOLUME = "shm"


class _PlainDumper(yaml.SafeDumper):
    """Writes a value shared by several services out in each (compose.yaml's anchors), never as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def swarm_config(image_config: dict[str, Any]) -> dict[str, Any]:
    """The containers' configuration under Swarm: the image's, with the API keys read from their secret."""
    config = copy.deepcopy(image_config)
    config.setdefault("gateway", {})["api_keys_file"] = f"/run/secrets/{API_KEYS_SECRET}"
    return config


def _deploy(service: dict[str, Any], role: str) -> dict[str, Any]:
    job = service.get("restart") == "no"
    limits = {key: value for key, value in (("memory", service.get("mem_limit")), ("cpus", service.get("cpus")))
              if value is not None}
    deploy: dict[str, Any] = {
        "mode": "global-job" if job else "global",
        "placement": {"constraints": [f"node.labels.{ROLE_LABEL} == {role}"]},
        "restart_policy": {"condition": "on-failure" if job else "any", "delay": "5s"},
    }
    if limits:
        deploy["resources"] = {"limits": {k: str(v) if k == "cpus" else v for k, v in limits.items()}}
    return deploy


def _host_port(spec: str | dict) -> dict[str, Any]:
    """``[ip:]published:target`` as Swarm's long form, published on the node itself (mode host)."""
    if isinstance(spec, dict):
        return {**spec, "mode": "host"}
    published, target = str(spec).split(":")[-2:]
    return {"target": int(target), "published": int(published), "protocol": "tcp", "mode": "host"}


def _absolute(source: str, base: Path) -> str:
    """A bind mount's source made absolute (Swarm wants it so), a ``${VAR:-./default}``'s default included."""
    if source.startswith("${") and ":-" in source:
        variable, default = source[2:-1].split(":-", 1)
        return f"${{{variable}:-{_absolute(default, base)}}}"
    return str((base / source).resolve()) if source.startswith(".") else source


#: The node's shared memory: ``nocopy``, else Docker gives the fresh volume the image's /dev/shm mode (0755 root)
#: and the services' user cannot create a segment in it.
SHM_MOUNT = {"type": "volume", "source": SHM_VOLUME, "target": "/dev/shm", "volume": {"nocopy": True}}


def _volumes(service: dict[str, Any], base: Path) -> list[Any]:
    """The service's mounts, and the node's shared /dev/shm for a service that shared inference's IPC."""
    mounts: list[Any] = []
    for mount in service.get("volumes", []):
        mount = str(mount)
        cut = mount.index("}") + 1 if mount.startswith("${") else mount.index(":")
        source, target = mount[:cut], mount[cut + 1:]
        mounts.append(f"{_absolute(source, base)}:{target}")
    return [*mounts, SHM_MOUNT] if "ipc" in service else mounts


def swarm_service(name: str, service: dict[str, Any], base: Path, role: str = "robot") -> dict[str, Any]:
    """One compose service as a Swarm service (see the module docstring for each change)."""
    out = {key: value for key, value in service.items() if key not in SWARM_DROPS}
    out["volumes"] = _volumes(service, base)
    out["deploy"] = _deploy(service, role)
    out["configs"] = [{"source": CONFIG_NAME, "target": CONFIG_PATH, "uid": SERVICE_UID, "mode": 0o400}]
    if "ports" in service:
        out["ports"] = [_host_port(port) for port in service["ports"]]
    if WATCHDOG_BACKEND_ENV in service.get("environment", {}):
        out["environment"] = {**service["environment"], WATCHDOG_BACKEND_ENV: "swarm"}
    if name == "gateway":
        out["secrets"] = [{"source": API_KEYS_SECRET, "uid": SERVICE_UID, "mode": 0o400}]
    return out


def swarm_stack(compose_file: Path, config_file: Path) -> dict[str, Any]:
    """The stack file's content for ``compose_file``; ``config_file`` is the Swarm config's path."""
    compose = yaml.safe_load(compose_file.read_text())
    base = compose_file.parent
    services = {name: swarm_service(name, service, base) for name, service in compose["services"].items()}
    volumes = {name: spec for name, spec in (compose.get("volumes") or {}).items()}
    volumes[SHM_VOLUME] = {"driver": "local", "driver_opts": {"type": "tmpfs", "device": "tmpfs",
                                                              "o": "size=512m,mode=1777"}}
    return {"version": "3.9", "services": services, "volumes": volumes,
            "configs": {CONFIG_NAME: {"file": str(config_file.resolve())}},
            "secrets": {API_KEYS_SECRET: {"external": True}}}


def write_stack(compose_file: Path, image_config: Path, out_dir: Path) -> Path:
    """Write ``stack.yaml`` and its ``magnitude.yaml`` into ``out_dir``; returns the stack file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_file = out_dir / "magnitude.yaml"
    config_file.write_text(yaml.safe_dump(swarm_config(yaml.safe_load(image_config.read_text()) or {}),
                                          sort_keys=False))
    stack_file = out_dir / "stack.yaml"
    stack_file.write_text("# Generated by `magnitude fleet stack` from compose.yaml: edit that, not this.\n"
                          + yaml.dump(swarm_stack(compose_file, config_file), Dumper=_PlainDumper, sort_keys=False))
    return stack_file
