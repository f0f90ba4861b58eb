"""Service processes on this machine: pid files, start, stop, liveness.

Each service is ``python -m services.<name>``, detached into its own session,
its stderr (JSON logs) in ``<run_dir>/<name>.log`` (rotated by size by the
service itself: ``runtime.log_max_bytes``, ``shared.logs``) and its pid in
``<run_dir>/<name>.pid``. The launcher (``magnitude up``) and the watchdog's
local backend both start and stop services through this module.

A pid file is written after the process exists, so a starter that dies in
between (a watchdog failing its own start) leaves a service no pid file names.
Every process started here therefore carries its stack's run directory in its
environment (``STACK_ENV``), and ``stack_processes`` finds them by it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil

from shared.config import Config
from shared.logs import rotation_env
from shared.security import private_dir

#: This process's identity: unique across restarts where pids repeat (each container numbers its processes from
#: 1, so a replaced inference container has the old one's pid). Said in ``health`` and in telemetry.
INSTANCE = uuid.uuid4().hex[:16]

_REPO_ROOT = Path(__file__).resolve().parent.parent
#: Set in every spawned service's environment (inherited by what it starts): the stack's run directory.
STACK_ENV = "MAGNITUDE_STACK"


def pid_file(config: Config, name: str) -> Path:
    return config.runtime.run_dir() / f"{name}.pid"


def log_file(config: Config, name: str) -> Path:
    return config.runtime.run_dir() / f"{name}.log"


#: The kernel's ceiling for pid_max (PID_MAX_LIMIT): no process has a larger pid.
_PID_LIMIT = 1 << 22


def is_alive(pid: int) -> bool:
    """True while ``pid`` is alive. An exited child of ours is reaped here (the watchdog is the parent of
    what it restarts); a zombie whose parent has not reaped it yet counts as exited once its last thread has.
    A number that cannot be a pid (0 or below would name process groups to ``waitpid``) is no live process."""
    if not 0 < pid <= _PID_LIMIT:
        return False
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass  # not our child: its own parent reaps it
    try:
        proc = psutil.Process(pid)
        # A zombie leader whose other threads still run has not exited: its process ends with the last thread
        # (seen on a service's SIGTERM: "Z", 2 threads, and the parent could not reap it yet).
        return proc.status() != psutil.STATUS_ZOMBIE or proc.num_threads() > 1
    except psutil.AccessDenied:
        return True  # another user's process: it exists
    except psutil.Error:
        return False


def read_pid(config: Config, name: str) -> int | None:
    """The pid of a running service process, or None (a stale pid file is removed)."""
    path = pid_file(config, name)
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and is_alive(pid):
        return pid
    path.unlink(missing_ok=True)
    return None


def spawn(config: Config, name: str, config_path: str | None,
          extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``python -m services.<name>`` in its own session (it outlives its parent) and write its pid file."""
    run_dir = config.runtime.run_dir()
    private_dir(run_dir)
    cmd = [sys.executable, "-m", f"services.{name}"] + (["--config", str(config_path)] if config_path else [])
    log_path = log_file(config, name)
    env = dict(os.environ, **(extra_env or {}), **{STACK_ENV: _stack_mark(config)},
               **rotation_env(log_path, config.runtime.log_max_bytes, config.runtime.log_backups),
               PYTHONPATH=os.pathsep.join(filter(None, [str(_REPO_ROOT), os.environ.get("PYTHONPATH")])))
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                start_new_session=True)
    pid_file(config, name).write_text(str(proc.pid))
    return proc


def stop(config: Config, name: str, timeout_s: float | None = None) -> str:
    """SIGTERM (the service drains in-flight work), then SIGKILL after ``timeout_s`` (default: the drain
    timeout and a margin; 0: a hung one, at once)."""
    pid = read_pid(config, name)
    if pid is None:
        return "not running"
    outcome = stop_pid(pid, config.runtime.stop_timeout_s() if timeout_s is None else timeout_s)
    pid_file(config, name).unlink(missing_ok=True)
    return outcome


def stop_pid(pid: int, timeout_s: float) -> str:
    if timeout_s > 0 and signal_and_wait(pid, signal.SIGTERM, timeout_s):
        return f"stopped (pid {pid})"
    signal_and_wait(pid, signal.SIGKILL, 10.0)
    return f"killed (pid {pid}) after {timeout_s:g}s"


def _stack_mark(config: Config) -> str:
    return str(config.runtime.run_dir().resolve())


def stack_processes(config: Config) -> dict[int, str]:
    """pid -> command line of every live process of this uid that carries this stack's mark, pid file or not."""
    mark, uid, found = _stack_mark(config), os.getuid(), {}
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.info["uids"].real == uid and proc.pid != os.getpid() and proc.environ().get(STACK_ENV) == mark:
                found[proc.pid] = " ".join(proc.info["cmdline"] or [])[:120]
        except psutil.Error:
            continue  # gone, or not readable: not one of ours
    return found


def signal_and_wait(pid: int, sig: int, wait_s: float) -> bool:
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
