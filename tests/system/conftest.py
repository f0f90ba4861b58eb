"""What the Docker end-to-end tests share: the engine's checks and the image they build (compose and Swarm).

Without a Docker engine, compose or root a local run skips with the reason; under CI=true it fails, because CI
must run these (.ci/run installs and starts them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from tests.conftest import REPO, REPORT

IMAGE = "magnitude:e2e"


def run(*cmd: str, timeout: float = 600, check: bool = True, **env: str) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **env})
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def compose_command() -> list[str] | None:
    """`docker compose` (v2 plugin) where it works, else Debian's `docker-compose` (v1)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


def missing_requirement() -> str | None:
    if not shutil.which("docker"):
        return "no docker CLI (apt-get install docker.io)"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        return "no Docker engine answers (start dockerd as root)"
    if compose_command() is None:
        return "no compose (apt-get install docker-compose)"
    if os.geteuid() != 0:
        return "not root: the base image needs debootstrap and the run volume's sockets are root's"
    return None


COMPOSE = compose_command() or []


@pytest.fixture(scope="session")
def image():
    """The image, built offline as a user would (each docker test module uses it; built once per run)."""
    missing = missing_requirement()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Docker end-to-end tests must run in CI, but {missing}; .ci/run installs "
                        "docker.io and docker-compose and starts dockerd", pytrace=False)
        pytest.skip(f"Docker end-to-end tests: {missing}")
    timings = {}
    for step, cmd in (("base image", ["bash", "scripts/provision/base_image"]), ("wheelhouse", ["bash", "scripts/provision/wheelhouse"]),
                      ("offline image build", ["docker", "build", "--network", "none", "--build-arg",
                                               "INSTALL_FROM=wheelhouse", "-t", IMAGE, "."])):
        start = time.monotonic()
        run(*cmd, timeout=900)
        timings[step] = time.monotonic() - start
    size_mb = int(run("docker", "image", "inspect", "-f", "{{.Size}}", IMAGE).stdout) / 1e6
    versions = run("docker", "version", "-f", "client {{.Client.Version}}, engine {{.Server.Version}}").stdout.strip()
    compose_version = run(*COMPOSE, "version", "--short", check=False).stdout.strip()
    REPORT.append(f"docker image: {' | '.join(f'{k} {v:.0f} s' for k, v in timings.items())}; image {IMAGE} "
                  f"{size_mb:.0f} MB (docker {versions}; {' '.join(COMPOSE)} {compose_version})")
    return size_mb
