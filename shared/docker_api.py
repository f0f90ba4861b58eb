"""The Docker engine's API, reached one way by whoever needs it: the watchdog's ``docker`` and ``swarm`` backends
and ``magnitude fleet``. Each caller says in its own words what it needed the API for; this says why it is not
there.
"""

from __future__ import annotations

from typing import Any


class DockerUnreachable(RuntimeError):
    """No Docker API answers (no socket, DOCKER_HOST wrong, the engine down, no SDK's transport); the message says
    why in the SDK's words."""


def docker_client() -> Any:
    """A client of the Docker API (DOCKER_HOST, else the socket) that has answered a ping, or DockerUnreachable."""
    import docker  # only what talks to an engine needs the SDK, imported when it does

    # The "attr-defined" ignores: mypy takes the repository's docker/ folder (no __init__.py) for this import, as
    # the SDK ships no type information; at run time the installed SDK is imported.
    try:
        client = docker.from_env()  # type: ignore[attr-defined]
        client.ping()
    except docker.errors.DockerException as err:  # type: ignore[attr-defined]
        raise DockerUnreachable(f"cannot reach the Docker API ({err})") from None
    return client
