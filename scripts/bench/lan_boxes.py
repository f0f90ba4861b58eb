"""Two boxes of a LAN on one Docker engine, set up one way for the test and the benchmark of inference on another
box (tests/system/test_lan_inference_e2e.py, scripts/bench/lan.py; docs/fleet.md).

Containers of the stack's image on a user-defined network: the inference box at ``.10`` of its /24, a robot at
``.20``. They share one folder of this machine, mounted at ``/lan``, that ``prepare`` fills: the box's CURVE keys
and the clients it knows, each client's side of them, the model, and every side's configuration. The caller
(root) hands it to the image's user.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from shared.security import create_keys

MOUNT = "/lan"
SERVICE_UID = 10001  # the image's user
#: The box's runtime: its run and data folders and its keys (the server's keypair, the clients it lets in).
BOX_RUNTIME = {"runtime_dir": f"{MOUNT}/box-run", "data_dir": f"{MOUNT}/box-data", "keys_dir": f"{MOUNT}/keys"}
#: Where a box that serves the LAN binds inference (beyond loopback: CURVE is required).
BOX_ENDPOINTS = {"inference": "tcp://0.0.0.0:5555"}


class LanError(RuntimeError):
    """A docker command that failed, or a box that did not start; the message says which and the engine's words."""


def docker(*args: str, check: bool = True) -> str:
    """``docker ARGS``' standard output; LanError with its standard error when it fails (unless not ``check``)."""
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise LanError(f"docker {' '.join(args[:3])} ...: {out.stderr.strip()[-1500:]}")
    return out.stdout


def prepare(home: Path, model: Path, engine: dict, boxes: dict[str, dict], box_ip: str,
            strangers: tuple[str, ...] = ()) -> None:
    """Under ``home``: the box's keys (``keys/``: the server's keypair, the robot's in ``clients/``), each client's
    side (``NAME-side/``: the box's public key and the client's own keypair; a stranger's was made apart, so the box
    does not know it), the model (``models/``), and the configurations: ``BOX.yaml`` for each of ``boxes`` (the
    box's runtime with those settings over it, and ``engine`` on the model), ``NAME.yaml`` for the robot and each
    stranger (inference at ``box_ip`` over tcp + CURVE). All owned by the image's user, its folders 0700."""
    create_keys(home / "keys", ["robot"])
    for stranger in strangers:
        create_keys(home / f"{stranger}-keys", [stranger])  # a keypair of its own, unknown to the box
    for client, keys in (("robot", "keys"), *((s, f"{s}-keys") for s in strangers)):
        (home / f"{client}-side").mkdir()
        shutil.copy(home / "keys" / "server.key", home / f"{client}-side" / "server.key")
        shutil.copy(home / keys / f"client-{client}.key_secret", home / f"{client}-side")
    (home / "models").mkdir()
    shutil.copy(model, home / "models")
    for box, runtime in boxes.items():
        _config(home / f"{box}.yaml", {**BOX_RUNTIME, **runtime},
                engine={"model_path": f"{MOUNT}/models/{model.name}", **engine})
    for client in ("robot", *strangers):
        _config(home / f"{client}.yaml", {"runtime_dir": f"{MOUNT}/{client}-run", "keys_dir": f"{MOUNT}/{client}-side",
                                          "client_key": client, "endpoints": {"inference": f"tcp://{box_ip}:5555"}})
    for path in (home, *home.rglob("*")):
        os.chown(path, SERVICE_UID, SERVICE_UID)
        if path.is_dir():
            path.chmod(0o700)


def _config(path: Path, runtime: dict, **sections: dict) -> None:
    path.write_text(yaml.safe_dump({"runtime": runtime, "metrics": {"enabled": False}, **sections}))


@dataclass(frozen=True)
class Lan:
    """The network ``name`` on ``prefix``.0/24 and its containers of ``image``, each mounting ``home`` at /lan."""

    name: str
    prefix: str  # "172.30.99": the box at .10, the robot at .20
    home: Path
    image: str

    def ip(self, host: int) -> str:
        return f"{self.prefix}.{host}"

    @property
    def box_ip(self) -> str:
        return self.ip(10)

    @property
    def robot_ip(self) -> str:
        return self.ip(20)

    def create(self, *containers: str) -> None:
        """The network, afresh: ``containers`` and the network a run before left are removed first."""
        self.remove(*containers)
        docker("network", "create", "--subnet", f"{self.prefix}.0/24", self.name)

    def remove(self, *containers: str) -> None:
        """``containers`` and the network, where they exist."""
        if containers:
            docker("rm", "-f", *containers, check=False)
        docker("network", "rm", self.name, check=False)

    def run(self, name: str, ip: str, config: str, *command: str, detach: bool = True,
            options: tuple[str, ...] = ()) -> str:
        """``command`` in a container ``name`` at ``ip`` with the configuration ``/lan/CONFIG``: started
        (``detach``), else run to its end and removed, its standard output returned."""
        return docker("run", "-d" if detach else "--rm", "--name", name, "--network", self.name, "--ip", ip, *options,
                      "-v", f"{self.home}:{MOUNT}", "-e", f"MAGNITUDE_CONFIG={MOUNT}/{config}", self.image, *command)

    def start_box(self, name: str, config: str, timeout_s: float, options: tuple[str, ...] = ()) -> None:
        """A fresh inference container ``name`` at the box's address, once its service has started (its log,
        on its standard error, says ``service_started``); LanError with the log's end after ``timeout_s``."""
        docker("rm", "-f", name, check=False)
        self.run(name, self.box_ip, config, "python", "-m", "services.inference", options=options)
        deadline = time.monotonic() + timeout_s
        while "service_started" not in (log := subprocess.run(["docker", "logs", name], capture_output=True,
                                                              text=True).stderr):
            if time.monotonic() > deadline:
                raise LanError(f"inference did not start within {timeout_s:g} s: {log[-3000:]}")
            time.sleep(0.5)
