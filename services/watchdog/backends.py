"""How the watchdog sees and restarts a service: local processes, compose containers through the docker API, or
the tasks of a Docker Swarm stack on this node.

All answer the same few questions (is it running, how much memory, start it,
restart it, give it priority), so the supervisor's logic is the same for each.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Protocol

import psutil

from shared import docker_api, process
from services.watchdog.priority import pin_process, renice_process
from shared.config import Config
from shared.config.operations import BACKEND_KINDS, WATCHDOG_BACKEND_ENV

DOCKER_SOCKET = Path("/var/run/docker.sock")
SERVICE_LABEL = "com.docker.compose.service"
PROJECT_LABEL = "com.docker.compose.project"
STACK_LABEL = "com.docker.stack.namespace"
SWARM_SERVICE_LABEL = "com.docker.swarm.service.name"
SWARM_NODE_LABEL = "com.docker.swarm.node.id"


class BackendError(RuntimeError):
    """A service the backend cannot find or act on (logged by the supervisor, retried next beat)."""


class Backend(Protocol):
    kind: str
    #: The platform itself replaces a service that exited (Swarm): the watchdog waits instead of starting it.
    replaces_exited: bool

    def pid(self, name: str) -> int | None:
        """The service's pid while it runs; None when it is not running."""

    def memory_mb(self, name: str) -> float | None:
        """What the service uses now (RSS, or the container's usage), None if unknown."""

    def start(self, name: str) -> None:
        """Start a service that is not running; returns at once, the heartbeat sees it come up."""

    def restart(self, name: str, hard: bool) -> None:
        """Restart a running service: ``hard`` kills at once (it is hung), else it drains first."""

    def set_nice(self, name: str, nice: int) -> None:
        """Give the service this nice value (PermissionError / NotImplementedError when it cannot)."""

    def pin(self, name: str, cpus: set[int]) -> None:
        """Restrict the service to these CPUs."""


class LocalBackend:
    """Services as local processes with pid files (``shared.process``); restarted ones are our children."""

    kind = "local"
    replaces_exited = False

    def __init__(self, config: Config, config_path: str | None):
        self.config = config
        self.config_path = config_path

    def pid(self, name: str) -> int | None:
        return process.read_pid(self.config, name)  # reaps our exited children; a zombie is not running

    def memory_mb(self, name: str) -> float | None:
        pid = self.pid(name)
        try:
            return psutil.Process(pid).memory_info().rss / 2**20 if pid else None
        except psutil.Error:
            return None

    def start(self, name: str) -> None:
        process.spawn(self.config, name, self.config_path)

    def restart(self, name: str, hard: bool) -> None:
        process.stop(self.config, name, timeout_s=0 if hard else None)  # hard: SIGKILL at once, no drain
        self.start(name)

    def set_nice(self, name: str, nice: int) -> None:
        pid = self.pid(name)
        if pid:
            renice_process(pid, nice)

    def pin(self, name: str, cpus: set[int]) -> None:
        pid = self.pid(name)
        if pid:
            pin_process(pid, cpus)


class DockerBackend:
    """Compose containers, found by their compose labels, through the docker SDK."""

    kind = "docker"
    replaces_exited = False

    def __init__(self, client: Any, project: str | None, stop_timeout_s: int):
        self.client = client
        self.project = project
        self.stop_timeout_s = stop_timeout_s

    @classmethod
    def from_env(cls, project: str | None, stop_timeout_s: int) -> "DockerBackend":
        """Connect through DOCKER_HOST or the mounted socket; the project defaults to our own container's."""
        client = docker_client()
        if project is None:
            project = own_container_labels(client).get(PROJECT_LABEL)  # None: match services of any project
        return cls(client, project, stop_timeout_s)

    def labels(self, name: str) -> list[str]:
        """The labels that find the service's container."""
        return [f"{SERVICE_LABEL}={name}"] + ([f"{PROJECT_LABEL}={self.project}"] if self.project else [])

    def _container(self, name: str) -> Any:
        labels = self.labels(name)
        found = self.client.containers.list(all=True, filters={"label": labels})
        if not found:
            raise BackendError(f"no container labelled {', '.join(labels)}")
        return found[0]

    def pid(self, name: str) -> int | None:
        container = self._container(name)
        if container.status != "running":
            return None
        return container.attrs["State"]["Pid"] or None

    def memory_mb(self, name: str) -> float | None:
        memory = self._container(name).stats(stream=False, one_shot=True).get("memory_stats") or {}
        if "usage" not in memory:
            return None
        detail = memory.get("stats") or {}
        # What `docker stats` shows: page cache that can be dropped is not counted (cgroup v2 / v1 names).
        cache = detail.get("inactive_file", detail.get("total_inactive_file", detail.get("cache", 0)))
        return (memory["usage"] - cache) / 2**20

    def start(self, name: str) -> None:
        container = self._container(name)
        if container.status != "restarting":  # else docker's own restart policy is already bringing it back
            container.start()

    def restart(self, name: str, hard: bool) -> None:
        container = self._container(name)
        if hard:
            container.kill()
            container.start()
        else:
            container.restart(timeout=self.stop_timeout_s)

    def set_nice(self, name: str, nice: int) -> None:
        raise NotImplementedError("a container has no nice value; give inference more cpu_shares in compose.yaml")

    def pin(self, name: str, cpus: set[int]) -> None:
        self._container(name).update(cpuset_cpus=",".join(str(c) for c in sorted(cpus)))


class SwarmBackend(DockerBackend):
    """The tasks of a Swarm stack on this node (each robot's box runs every service once, ``mode: global``).

    Swarm replaces a task whose container exits (the stack's ``restart_policy``), so the watchdog never starts
    one: it waits for Swarm. A hung or bloated task is ended through this node's engine (killed, or stopped with
    the drain timeout) and Swarm starts its replacement. Not ``docker service update --force``: for a global
    service that replaces the task on every node, not the hung one. The container of a replaced task is gone
    with its CPU pinning; the supervisor pins the new one when it answers.
    """

    kind = "swarm"
    replaces_exited = True

    def __init__(self, client: Any, stack: str, node_id: str, stop_timeout_s: int):
        super().__init__(client, None, stop_timeout_s)
        self.stack, self.node_id = stack, node_id

    @classmethod
    def from_env(cls, project: str | None, stop_timeout_s: int) -> "SwarmBackend":
        """The stack and node of the container this watchdog runs in (``project`` names the stack outside one)."""
        client = docker_client()
        own = own_container_labels(client)
        stack = project or own.get(STACK_LABEL)
        if not stack:
            raise ValueError("watchdog.backend swarm: not in a stack's container; name the stack in "
                             "watchdog.compose_project")
        return cls(client, stack, own.get(SWARM_NODE_LABEL) or client.info()["Swarm"]["NodeID"], stop_timeout_s)

    def labels(self, name: str) -> list[str]:
        return [f"{SWARM_SERVICE_LABEL}={self.stack}_{name}", f"{SWARM_NODE_LABEL}={self.node_id}"]

    def _container(self, name: str) -> Any:
        """The running container of the service's task here; stopped ones are replaced tasks' leftovers."""
        labels = self.labels(name)
        found = self.client.containers.list(filters={"label": labels, "status": "running"})
        if not found:
            raise BackendError(f"no running container labelled {', '.join(labels)}")
        return found[0]

    def pid(self, name: str) -> int | None:
        try:
            return super().pid(name)
        except BackendError:
            return None  # between a task and its replacement

    def start(self, name: str) -> None:
        """Nothing to do: Swarm starts the replacement task (``replaces_exited``)."""

    def restart(self, name: str, hard: bool) -> None:
        container = self._container(name)
        if hard:
            container.kill()
        else:
            container.stop(timeout=self.stop_timeout_s)


def docker_client() -> Any:
    """A client of the docker API (DOCKER_HOST, else the socket), or ValueError saying why there is none."""
    try:
        return docker_api.docker_client()
    except docker_api.DockerUnreachable as err:
        raise ValueError(f"watchdog.backend docker: {err}") from None


def own_container_labels(client: Any) -> dict[str, str]:
    """The labels of the container this process runs in; {} outside one, or where the API does not know it."""
    import docker

    try:  # a container's hostname is its short id
        return client.containers.get(socket.gethostname()).labels or {}
    except docker.errors.DockerException:  # type: ignore[attr-defined]  # (why: shared/docker_api.py)
        return {}


def in_container() -> bool:
    return Path("/.dockerenv").exists() or Path("/run/.containerenv").exists()


def in_compose_container() -> bool:
    """True in a container of a compose project that can reach the docker API. A development box that
    is itself a container with a docker socket is not one: the services it runs are local processes."""
    if not (in_container() and DOCKER_SOCKET.exists()):
        return False
    try:
        return PROJECT_LABEL in own_container_labels(docker_client())
    except ValueError:
        return False


def choose_backend(config: Config) -> tuple[str, str]:
    """(kind, why). Whoever started the services says how they run: ``magnitude up`` passes local and
    compose.yaml docker in $MAGNITUDE_WATCHDOG_BACKEND; else ``watchdog.backend``. ``auto`` is docker only
    inside a compose container, never for the processes of a development box that has a docker socket."""
    passed = os.environ.get(WATCHDOG_BACKEND_ENV)
    if passed and passed not in BACKEND_KINDS:
        raise ValueError(f"{WATCHDOG_BACKEND_ENV}={passed!r}: must be one of {', '.join(BACKEND_KINDS)}")
    kind, why = (passed, f"${WATCHDOG_BACKEND_ENV}") if passed else (config.watchdog.backend, "watchdog.backend")
    if kind != "auto":
        return kind, why
    if in_compose_container():
        return "docker", f"{why} auto: a compose container that reaches the docker API"
    return "local", f"{why} auto: not a compose container"


def make_backend(kind: str, config: Config, config_path: str | None) -> Backend:
    if kind == "swarm":
        return SwarmBackend.from_env(config.watchdog.compose_project, round(config.runtime.stop_timeout_s()))
    if kind == "docker":
        return DockerBackend.from_env(config.watchdog.compose_project, round(config.runtime.stop_timeout_s()))
    return LocalBackend(config, config_path)
