"""Run the services as plain local processes: the way tests and a dev box run the stack.

Each service is ``python -m services.<name>``, detached into its own session,
its stderr (JSON logs) in ``<run_dir>/<name>.log`` and its pid in
``<run_dir>/<name>.pid``. The watchdog starts after the services and stops
before them; it restarts services through ``spawn``. Under compose, containers
replace this module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from magnitude.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config

_REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class ServiceStatus:
    name: str
    healthy: bool
    detail: dict
    error: str | None = None


def _pid_file(config: Config, name: str) -> Path:
    return config.runtime.run_dir() / f"{name}.pid"


def log_file(config: Config, name: str) -> Path:
    return config.runtime.run_dir() / f"{name}.log"


def read_pid(config: Config, name: str) -> int | None:
    """The pid of a running service process, or None (a stale pid file is removed)."""
    path = _pid_file(config, name)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and is_alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def check(config: Config, name: str, timeout_s: float = 5.0) -> ServiceStatus:
    try:
        with Client.for_service(name, config, timeout_s=timeout_s) as client:
            detail = client.health()
        return ServiceStatus(name, bool(detail.get("ok")), detail)
    except ServiceError as err:
        return ServiceStatus(name, False, {}, f"{err.code}: {err.message}")


def spawn(config: Config, name: str, config_path: str | None) -> subprocess.Popen:
    """Start ``python -m services.<name>`` in its own session (it outlives its parent) and write its pid file."""
    run_dir = config.runtime.run_dir()
    run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    cmd = [sys.executable, "-m", f"services.{name}"] + (["--config", str(config_path)] if config_path else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_file(config, name), "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True)
    _pid_file(config, name).write_text(str(proc.pid))
    return proc


def start(config: Config, name: str, config_path: str | None, wait_s: float = 120.0,
          progress=print) -> ServiceStatus:
    """Start one service unless it already runs; wait until it answers health."""
    if read_pid(config, name) is not None:
        status = check(config, name)
        if status.healthy:
            progress(f"{name}: already running (pid {status.detail.get('pid')})")
            return status
    proc = spawn(config, name, config_path)
    progress(f"{name}: starting (pid {proc.pid}, log {log_file(config, name)})")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_file(config, name).read_text(errors="replace").splitlines()[-5:]
            return ServiceStatus(name, False, {}, f"exited with code {proc.returncode}: " + " | ".join(tail))
        status = check(config, name, timeout_s=1.0)
        if status.healthy:
            return status
        time.sleep(0.2)
    return ServiceStatus(name, False, {}, f"not healthy after {wait_s:g}s (see {log_file(config, name)})")


def stop(config: Config, name: str, timeout_s: float = 30.0) -> str:
    """SIGTERM (the service drains in-flight work), then SIGKILL after ``timeout_s`` (0: a hung one, at once)."""
    pid = read_pid(config, name)
    if pid is None:
        return "not running"
    if timeout_s > 0 and _signal_and_wait(pid, signal.SIGTERM, timeout_s):
        outcome = f"stopped (pid {pid})"
    else:
        _signal_and_wait(pid, signal.SIGKILL, 10.0)
        outcome = f"killed (pid {pid}) after {timeout_s:g}s"
    _pid_file(config, name).unlink(missing_ok=True)
    return outcome


def _signal_and_wait(pid: int, sig: int, wait_s: float) -> bool:
    """Send ``sig`` and wait up to ``wait_s`` for the process to exit; True once it has."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return True
    deadline = time.monotonic() + wait_s
    while is_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def is_alive(pid: int) -> bool:
    """True while ``pid`` is alive. An exited child of ours is reaped here (the watchdog is the parent of
    what it restarts); a zombie whose parent has not reaped it yet counts as exited."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent reaps it
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def processes(config: Config) -> tuple[str, ...]:
    """What ``up`` starts, in order: the services, then the watchdog when it is enabled."""
    return SERVICE_NAMES + ((WATCHDOG_NAME,) if config.watchdog.enabled else ())


def up(config: Config, config_path: str | None, progress=print) -> list[ServiceStatus]:
    return [start(config, name, config_path, progress=progress) for name in processes(config)]


def down(config: Config) -> dict[str, str]:
    """The watchdog first (else it restarts what is being stopped), then the services in reverse order."""
    return {name: stop(config, name) for name in (WATCHDOG_NAME, *reversed(SERVICE_NAMES))}


def health(config: Config, names: list[str] | None = None, timeout_s: float = 5.0) -> list[ServiceStatus]:
    return [check(config, name, timeout_s) for name in (names or processes(config))]
