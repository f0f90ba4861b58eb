"""The fleet seen from a Swarm manager: Swarm's view of nodes and tasks, and a probe job on every robot node.

``run_probe`` starts ``magnitude.fleet.probe`` as a one-shot service in the stack's own image (``global``, never
restarted), with the node's ``run`` volume and the stack's configuration, waits until every node's task has
ended, reads the line each printed from the service's logs (the manager gathers them from the nodes), and
removes the service. Only the Docker API is used: no port, key or ssh reaches the nodes. Not a ``global-job``:
this engine (20.10) keeps a job's exited containers after its service is removed, and with them the volumes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from magnitude.fleet.probe import MARKER
from magnitude.fleet.stack import CONFIG_NAME, CONFIG_PATH, ROLE_LABEL, SERVICE_UID

STACK_LABEL = "com.docker.stack.namespace"
DONE_STATES = {"complete", "failed", "rejected", "shutdown", "orphaned"}
PROBE_TIMEOUT_S = 120.0


class FleetError(RuntimeError):
    """What the fleet commands cannot do (no swarm, no such stack, a probe that did not finish); the message says
    why."""


def swarm_client() -> Any:
    import docker

    try:
        client = docker.from_env()  # type: ignore[attr-defined]
        if client.info()["Swarm"].get("ControlAvailable") is not True:
            raise FleetError("this engine is not a Swarm manager: run `magnitude fleet` on a manager node")
    except docker.errors.DockerException as err:  # type: ignore[attr-defined]
        raise FleetError(f"cannot reach the Docker API ({err})") from None
    return client


def stack_services(client: Any, stack: str) -> list[Any]:
    found = client.services.list(filters={"label": f"{STACK_LABEL}={stack}"})
    if not found:
        raise FleetError(f"no stack {stack!r} on this swarm (docker stack ls)")
    return found


def swarm_view(client: Any, stack: str) -> dict[str, dict[str, Any]]:
    """Per node (hostname): its role label, availability and state, and each stack service's task state there."""
    nodes = {n.id: n.attrs for n in client.nodes.list()}
    view = {attrs["Description"]["Hostname"]: {
        "role": attrs["Spec"].get("Labels", {}).get(ROLE_LABEL), "state": attrs["Status"]["State"],
        "availability": attrs["Spec"]["Availability"], "tasks": {}} for attrs in nodes.values()}
    for service in stack_services(client, stack):
        name = service.name.removeprefix(f"{stack}_")
        if service.attrs["Spec"].get("Mode", {}).get("GlobalJob") is not None:
            continue  # the setup jobs: done once, not a service to watch
        for task in service.tasks(filters={"desired-state": "running"}):
            node = nodes.get(task.get("NodeID"))
            if node is not None:
                view[node["Description"]["Hostname"]]["tasks"][name] = task["Status"]["State"]
    return view


def _mounts_and_configs(client: Any, stack: str, extra_configs: list[Any]) -> tuple[list[Any], list[Any]]:
    import docker.types

    [config] = client.configs.list(filters={"name": f"{stack}_{CONFIG_NAME}"}) or [None]
    if config is None:
        raise FleetError(f"stack {stack!r} has no {CONFIG_NAME} config")
    mounts = [docker.types.Mount(target="/run/magnitude", source=f"{stack}_run", type="volume")]
    configs = [docker.types.ConfigReference(config.id, config.name, filename=CONFIG_PATH, uid=SERVICE_UID,
                                            mode=0o400), *extra_configs]
    return mounts, configs


def run_probe(client: Any, stack: str, args: list[str], constraints: list[str] | None = None,
              extra_configs: list[Any] | None = None, timeout_s: float = PROBE_TIMEOUT_S,
              progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """``magnitude.fleet.probe ARGS`` once on every robot node (and ``constraints``): each node's JSON line."""
    import docker.types

    image = client.services.get(f"{stack}_inference").attrs["Spec"]["TaskTemplate"]["ContainerSpec"]["Image"]
    mounts, configs = _mounts_and_configs(client, stack, extra_configs or [])
    service = client.services.create(
        image, command=["python", "-m", "magnitude.fleet.probe", *args], name=f"{stack}_probe-{uuid.uuid4().hex[:8]}",
        mode=docker.types.ServiceMode("global"), restart_policy=docker.types.RestartPolicy("none"),
        constraints=[f"node.labels.{ROLE_LABEL} == robot", *(constraints or [])], mounts=mounts, configs=configs,
        env=["NODE_NAME={{.Node.Hostname}}", f"MAGNITUDE_CONFIG={CONFIG_PATH}"], labels={STACK_LABEL: stack})
    try:
        progress(f"probe {args[0]}: started {service.name}")
        deadline = time.monotonic() + timeout_s
        while True:
            states = [t["Status"]["State"] for t in service.tasks()]
            if states and all(state in DONE_STATES for state in states):
                break
            if time.monotonic() > deadline:
                raise FleetError(f"probe {args[0]} did not finish within {timeout_s:g} s (task states: {states})")
            time.sleep(1)
        progress(f"probe {args[0]}: {len(states)} node(s) answered")
        text = b"".join(service.logs(stdout=True, stderr=True)).decode(errors="replace")
    finally:
        service.remove()
    return [json.loads(line.split(MARKER, 1)[1]) for line in text.splitlines() if MARKER in line]
