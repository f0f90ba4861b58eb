"""Run the stack as plain local processes: the way tests and a dev box run it (``magnitude up/down``).

The process mechanics (pid files, logs, signals) are ``shared.process``; this
module adds the order (services, then the watchdog) and waits for health.
Under compose, containers replace it.
"""

from __future__ import annotations

import time

from shared import process
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config
from shared.config.operations import WATCHDOG_BACKEND_ENV
from shared.health import ServiceStatus, probe

#: What the launcher tells a process it starts: the watchdog supervises these local processes, never
#: containers, whatever ``watchdog.backend: auto`` would guess on a box that has a docker socket.
PROCESS_ENV = {WATCHDOG_NAME: {WATCHDOG_BACKEND_ENV: "local"}}


def start(config: Config, name: str, config_path: str | None, wait_s: float = 120.0,
          progress=print) -> ServiceStatus:
    """Start one service unless it already runs; wait until it answers health."""
    if process.read_pid(config, name) is not None:
        status = probe(config, name)
        if status.healthy:
            progress(f"{name}: already running (pid {status.detail.get('pid')})")
            return status
    proc = process.spawn(config, name, config_path, PROCESS_ENV.get(name))
    log = process.log_file(config, name)
    progress(f"{name}: starting (pid {proc.pid}, log {log})")
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace").splitlines()[-5:]
            return ServiceStatus(name, False, {}, f"exited with code {proc.returncode}: " + " | ".join(tail))
        status = probe(config, name, timeout_s=1.0)
        if status.healthy:
            return status
        time.sleep(0.2)
    return ServiceStatus(name, False, {}, f"not healthy after {wait_s:g}s (see {log})")


def processes(config: Config) -> tuple[str, ...]:
    """What ``up`` starts, in order: the services, then the watchdog when it is enabled."""
    return SERVICE_NAMES + ((WATCHDOG_NAME,) if config.watchdog.enabled else ())


def up(config: Config, config_path: str | None, progress=print) -> list[ServiceStatus]:
    return [start(config, name, config_path, progress=progress) for name in processes(config)]


def down(config: Config) -> dict[str, str]:
    """The watchdog first (else it restarts what is being stopped), then the services in reverse order; then
    any process of the stack no pid file names (its starter died before writing it, as in a failed ``up``)."""
    stopped = {name: process.stop(config, name) for name in (WATCHDOG_NAME, *reversed(SERVICE_NAMES))}
    for pid, cmdline in process.stack_processes(config).items():
        stopped[cmdline] = process.stop_pid(pid, config.runtime.stop_timeout_s())
    return stopped


def health(config: Config, names: list[str] | None = None, timeout_s: float = 5.0) -> list[ServiceStatus]:
    return [probe(config, name, timeout_s) for name in (names or processes(config))]
