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

With ``split=True`` (a light robot leaves the model to a stronger box of its LAN) inference, the optimizer that
tunes it and the setup job that brings its model run on the nodes labelled ``magnitude.role=inference`` (one
inference, where every robot's sessions stay), and the robots' services reach them over ``tcp://`` on the stack's
network with CURVE: each side gets its own Swarm config naming the endpoints (a service binds its own
``tcp://0.0.0.0:PORT`` and connects to the others by service name) and the keys as Swarm secrets under
``/run/secrets/curve`` (the inference side holds the server's secret key, every service the client's).
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
ROBOT = f"node.labels.{ROLE_LABEL} == robot"
INFERENCE_NODE = f"node.labels.{ROLE_LABEL} == inference"

#: Split: what runs beside inference, and the ports the robots reach inference and the optimizer on.
INFERENCE_SIDE = ("setup", "inference", "optimizer")
SPLIT_PORTS = {"inference": 5555, "optimizer": 5556}
CURVE_DIR = "/run/secrets/curve"
CURVE_CLIENT = "fleet"  # the one client key of the fleet's services: scripts/ops/keys init --client fleet
#: Split: the CURVE keys as Swarm secrets, by secret name: the file under CURVE_DIR that each becomes. Every
#: service holds the client's; the inference side also the server's.
CLIENT_SECRETS = {"magnitude_curve_server_public": "server.key",
                  "magnitude_curve_client": f"client-{CURVE_CLIENT}.key_secret"}
SERVER_SECRETS = {"magnitude_curve_server": "server.key_secret",
                  "magnitude_curve_client_public": f"clients/{CURVE_CLIENT}.key"}


class _PlainDumper(yaml.SafeDumper):
    """Writes a value shared by several services out in each (compose.yaml's anchors), never as an alias."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def swarm_config(image_config: dict[str, Any], binds: str | None = None, split: bool = False) -> dict[str, Any]:
    """The containers' configuration under Swarm: the image's, with the API keys read from their secret; split,
    the endpoints over tcp (``binds``: the inference-side service whose own endpoint this config binds) and the
    CURVE keys."""
    config = copy.deepcopy(image_config)
    config.setdefault("gateway", {})["api_keys_file"] = f"/run/secrets/{API_KEYS_SECRET}"
    if split:
        runtime = config.setdefault("runtime", {})
        runtime["endpoints"] = {name: f"tcp://{'0.0.0.0' if name == binds else name}:{port}"
                                for name, port in SPLIT_PORTS.items()}
        runtime.update(keys_dir=CURVE_DIR, client_key=CURVE_CLIENT)
    return config


def config_name(service: str, split: bool) -> str:
    """The Swarm config a service reads: split, inference and the optimizer each bind their own endpoint."""
    return f"{CONFIG_NAME}_{service}" if split and service in SPLIT_PORTS else CONFIG_NAME


def _deploy(service: dict[str, Any], constraint: str, single: bool) -> dict[str, Any]:
    """``single``: one task in the swarm (split inference: every robot's sessions on one box), else one per node."""
    job = service.get("restart") == "no"
    limits = {key: value for key, value in (("memory", service.get("mem_limit")), ("cpus", service.get("cpus")))
              if value is not None}
    # A single task is reached at its own address (dnsrr), not through a virtual IP: Swarm's VIP needs the
    # kernel's IPVS, which a small board's kernel may lack, and a ZeroMQ connection re-resolves when it reconnects.
    mode = ({"mode": "global-job"} if job else {"mode": "replicated", "replicas": 1, "endpoint_mode": "dnsrr"}
            if single else {"mode": "global"})
    deploy: dict[str, Any] = {
        **mode,
        "placement": {"constraints": [constraint]},
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


def _volumes(service: dict[str, Any], base: Path, shared_memory: bool) -> list[Any]:
    """The service's mounts, and (``shared_memory``) the node's shared /dev/shm."""
    mounts: list[Any] = []
    for mount in service.get("volumes", []):
        mount = str(mount)
        cut = mount.index("}") + 1 if mount.startswith("${") else mount.index(":")
        source, target = mount[:cut], mount[cut + 1:]
        mounts.append(f"{_absolute(source, base)}:{target}")
    return [*mounts, SHM_MOUNT] if shared_memory else mounts


def _secrets(name: str, service: dict[str, Any], split: bool) -> list[dict[str, Any]]:
    """The gateway's API keys; split, the CURVE keys of every service that talks (not the setup jobs)."""
    own = {"uid": SERVICE_UID, "mode": 0o400}
    secrets = [{"source": API_KEYS_SECRET, **own}] if name == "gateway" else []
    if split and service.get("restart") != "no":
        held = {**CLIENT_SECRETS, **(SERVER_SECRETS if name in INFERENCE_SIDE else {})}
        secrets += [{"source": secret, "target": f"curve/{path}", **own} for secret, path in held.items()]
    return secrets


def swarm_service(name: str, service: dict[str, Any], base: Path, placement: dict[str, str],
                  split: bool = False) -> dict[str, Any]:
    """One compose service as a Swarm service (see the module docstring for each change). ``placement``: the
    constraint of each side, ``robot`` and ``inference`` (split only)."""
    beside_inference = split and name in INFERENCE_SIDE
    out = {key: value for key, value in service.items() if key not in SWARM_DROPS}
    # Split, the inference side talks tcp only: no shared memory there.
    out["volumes"] = _volumes(service, base, shared_memory="ipc" in service and not beside_inference)
    out["deploy"] = _deploy(service, placement["inference" if beside_inference else "robot"], beside_inference)
    out["configs"] = [{"source": config_name(name, split), "target": CONFIG_PATH, "uid": SERVICE_UID,
                       "mode": 0o400}]
    if "ports" in service:
        out["ports"] = [_host_port(port) for port in service["ports"]]
    if WATCHDOG_BACKEND_ENV in service.get("environment", {}):
        out["environment"] = {**service["environment"], WATCHDOG_BACKEND_ENV: "swarm"}
    if secrets := _secrets(name, service, split):
        out["secrets"] = secrets
    return out


def swarm_stack(compose_file: Path, config_files: dict[str, Path], placement: dict[str, str],
                split: bool = False) -> dict[str, Any]:
    """The stack file's content for ``compose_file``; ``config_files``: each Swarm config's file, by name."""
    compose = yaml.safe_load(compose_file.read_text())
    base = compose_file.parent
    services = {name: swarm_service(name, service, base, placement, split)
                for name, service in compose["services"].items()}
    volumes = {name: spec for name, spec in (compose.get("volumes") or {}).items()}
    volumes[SHM_VOLUME] = {"driver": "local", "driver_opts": {"type": "tmpfs", "device": "tmpfs",
                                                              "o": "size=512m,mode=1777"}}
    secrets = [API_KEYS_SECRET, *((*CLIENT_SECRETS, *SERVER_SECRETS) if split else ())]
    return {"version": "3.9", "services": services, "volumes": volumes,
            "configs": {name: {"file": str(path.resolve())} for name, path in config_files.items()},
            "secrets": {name: {"external": True} for name in secrets}}


def write_stack(compose_file: Path, image_config: Path, out_dir: Path, split: bool = False,
                placement: dict[str, str] | None = None) -> Path:
    """Write ``stack.yaml`` and its configs (``magnitude*.yaml``) into ``out_dir``; returns the stack file's path.
    ``placement`` overrides the constraint of a side (``robot``, ``inference``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    image = yaml.safe_load(image_config.read_text()) or {}
    config_files = {}
    for binds in (None, *(SPLIT_PORTS if split else ())):
        path = out_dir / (f"magnitude-{binds}.yaml" if binds else "magnitude.yaml")
        path.write_text(yaml.safe_dump(swarm_config(image, binds, split), sort_keys=False))
        config_files[config_name(binds, split) if binds else CONFIG_NAME] = path
    stack = swarm_stack(compose_file, config_files, {"robot": ROBOT, "inference": INFERENCE_NODE,
                                                     **(placement or {})}, split)
    stack_file = out_dir / "stack.yaml"
    stack_file.write_text("# Generated by `magnitude fleet stack` from compose.yaml: edit that, not this.\n"
                          + yaml.dump(stack, Dumper=_PlainDumper, sort_keys=False))
    return stack_file
