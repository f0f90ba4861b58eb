"""The fleet seen from a Swarm manager: Swarm's view of nodes and tasks, and probes on the nodes.

``run_probe`` starts ``magnitude.fleet.probe`` as a one-shot service (``global``, never restarted) on every node
where the stack places a given service, as that service: its image, placement, configuration, secrets and the
node's ``run`` volume (so it reaches the node's services, and a split stack's inference, as they do). It waits
until every node's task has ended, reads the line each printed from the service's logs (the manager gathers them
from the nodes), and removes the service. Only the Docker API is used: no port, key or ssh reaches the nodes. Not
a ``global-job``: this engine (20.10) keeps a job's exited containers after its service is removed, and with them
the volumes.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable

from magnitude.fleet.probe import MARKER
from magnitude.fleet.stack import CONFIG_PATH, ROLE_LABEL
from services.watchdog.backends import STACK_LABEL
from shared import docker_api

DONE_STATES = {"complete", "failed", "rejected", "shutdown", "orphaned"}
PROBE_TIMEOUT_S = 120.0


class FleetError(RuntimeError):
    """What the fleet commands cannot do (no swarm, no such stack, a probe that did not finish); the message says
    why."""


def swarm_client() -> Any:
    """A client of this engine's Docker API, which must be a Swarm manager's; else FleetError saying so."""
    try:
        client = docker_api.docker_client()
    except docker_api.DockerUnreachable as err:
        raise FleetError(str(err)) from None
    if client.info()["Swarm"].get("ControlAvailable") is not True:
        raise FleetError("this engine is not a Swarm manager: run `magnitude fleet` on a manager node")
    return client


def stack_services(client: Any, stack: str) -> list[Any]:
    found = client.services.list(filters={"label": f"{STACK_LABEL}={stack}"})
    if not found:
        raise FleetError(f"no stack {stack!r} on this swarm (docker stack ls)")
    return found


def _watched(service: Any, stack: str) -> str | None:
    """The short name of a stack service to watch; None for a setup job or one of our probes."""
    name = service.name.removeprefix(f"{stack}_")
    job = service.attrs["Spec"].get("Mode", {}).get("GlobalJob") is not None
    return None if job or name.startswith("probe-") else name


def placement_groups(client: Any, stack: str) -> list[tuple[str, list[str]]]:
    """The stack's services grouped by where they are placed, each group as (the one to probe beside, all):
    one group, or two for a split stack (the robots', inference's)."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for service in stack_services(client, stack):
        if name := _watched(service, stack):
            placement = service.attrs["Spec"]["TaskTemplate"].get("Placement", {}).get("Constraints", [])
            groups.setdefault(tuple(placement), []).append(name)
    return [(sorted(names)[0], sorted(names)) for names in groups.values()]


def swarm_view(client: Any, stack: str) -> dict[str, dict[str, Any]]:
    """Per node (hostname): its role label, availability and state, and each stack service's task state there."""
    nodes = {n.id: n.attrs for n in client.nodes.list()}
    view = {attrs["Description"]["Hostname"]: {
        "role": attrs["Spec"].get("Labels", {}).get(ROLE_LABEL), "state": attrs["Status"]["State"],
        "availability": attrs["Spec"]["Availability"], "tasks": {}} for attrs in nodes.values()}
    for service in stack_services(client, stack):
        if (name := _watched(service, stack)) is None:
            continue
        for task in service.tasks(filters={"desired-state": "running"}):
            node = nodes.get(task.get("NodeID"))
            if node is not None:
                view[node["Description"]["Hostname"]]["tasks"][name] = task["Status"]["State"]
    return view


def _template(client: Any, stack: str, service: str) -> dict[str, Any]:
    """What a probe beside ``service`` gets from that service's spec: its image, placement, configuration,
    secrets (the CURVE keys of a split stack), ``run`` volume and networks (a split stack's inference is reached
    by name on the stack's)."""
    import docker

    try:
        spec = client.services.get(f"{stack}_{service}").attrs["Spec"]
    except docker.errors.NotFound:  # type: ignore[attr-defined]
        raise FleetError(f"stack {stack!r} has no service {service}") from None
    task, container = spec["TaskTemplate"], spec["TaskTemplate"]["ContainerSpec"]
    return {"image": container["Image"], "constraints": task["Placement"].get("Constraints", []),
            "configs": container.get("Configs", []), "secrets": container.get("Secrets", []),
            "mounts": [m for m in container.get("Mounts", []) if m["Target"] == "/run/magnitude"],
            "networks": [n["Target"] for n in task.get("Networks", [])]}


def run_probe(client: Any, stack: str, args: list[str], beside: str = "gateway", constraints: list[str] | None = None,
              extra_configs: list[Any] | None = None, timeout_s: float = PROBE_TIMEOUT_S,
              progress: Callable[[str], None] = lambda line: None) -> list[dict[str, Any]]:
    """``magnitude.fleet.probe ARGS`` once on every node where the stack places ``beside`` (and ``constraints``),
    as that service sees its peers: each node's JSON line."""
    import docker.types

    template = _template(client, stack, beside)
    service = client.services.create(
        template["image"], command=["python", "-m", "magnitude.fleet.probe", *args],
        name=f"{stack}_probe-{uuid.uuid4().hex[:8]}", mode=docker.types.ServiceMode("global"),
        restart_policy=docker.types.RestartPolicy("none"), constraints=[*template["constraints"], *(constraints or [])],
        mounts=template["mounts"], configs=[*template["configs"], *(extra_configs or [])], secrets=template["secrets"],
        networks=template["networks"],
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
