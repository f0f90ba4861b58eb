"""Run one python/shell tool call in a subprocess it cannot escape from by running long, big or loud.

Limits: rlimits set by the child itself (address space, CPU seconds, file size,
process count, under the tools' own uid when the service is root), a wall-clock
deadline after which everything the tool started is killed, and stdout read
through a cap: once the tool has written more than ``max_output_bytes`` it is
killed and what was kept comes back with a note, so 100 MB of output never sits
in this process. Where the child runs (a bubblewrap sandbox, or bare) is
``jail.Jail``'s business; under bubblewrap the kill takes the whole PID
namespace, bare it takes the process group and the descendants still attached.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.tools.child import EXIT_MEMORY, EXIT_RAISED
from services.tools.errors import tool_failed
from services.tools.jail import Jail
from shared.config import SandboxLimits

_CHILD = Path(__file__).with_name("child.py")
_STDERR_CAP = 4096


@dataclass
class Outcome:
    output: str
    truncated: bool
    elapsed_ms: float


@dataclass(frozen=True)
class Call:
    """One tool call's process: the child spec (``python`` target or ``argv``) and what it may see."""

    spec: dict
    limits: SandboxLimits
    roots: list[Path] = field(default_factory=list)  # declared by the tool, read-only
    network: bool = False
    python_path: list[str] = field(default_factory=list)  # a python tool's import path (roots come first)


def _nproc_limit(uid: int, headroom: int) -> int | None:
    """RLIMIT_NPROC counts all of a uid's processes, so the cap is today's count plus head-room (root is exempt)."""
    if uid == 0:
        return None
    running = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)
    return running + headroom


def _kill_everything(proc: subprocess.Popen, namespaced: bool) -> None:
    """SIGKILL what the tool started: the sandbox's init takes its PID namespace along; bare, the descendants
    still attached (a ``setsid`` one too) and the process group."""
    if not namespaced:
        try:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
        except psutil.Error:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _failure(returncode: int, stderr: str, limits: SandboxLimits):
    tail = stderr.strip().splitlines()[-1][:500] if stderr.strip() else ""
    if returncode == EXIT_MEMORY:
        return tool_failed("memory_limit", f"exceeded {limits.memory_mb} MB: {tail}")
    if returncode == EXIT_RAISED:
        return tool_failed("raised", tail or "the tool raised")
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return tool_failed("cpu_limit", f"used more than {limits.cpu_s} s of CPU")
    if returncode < 0:
        return tool_failed("crashed", f"killed by {signal.Signals(-returncode).name}" + (f": {tail}" if tail else ""))
    return tool_failed("raised", f"exited with status {returncode}" + (f": {tail}" if tail else ""))


def _command(call: Call, jail: Jail, child_limits: dict) -> list[str]:
    child = [jail.python, str(_CHILD), json.dumps({**call.spec, "limits": child_limits, "uid": jail.uid})]
    visible = [*jail.runtime_paths(), _CHILD, *(Path(p) for p in call.python_path if Path(p) not in call.roots)]
    if "argv" in call.spec:  # the command itself, wherever it is installed
        found = shutil.which(call.spec["argv"][0])
        visible += [Path(found)] if found else []
    return jail.wrap(child, visible=visible, roots=call.roots, network=call.network,
                     tmp_mb=max(16, call.limits.max_file_mb))


def confined(call: Call, jail: Jail) -> tuple[list[str], dict[str, str]]:
    """The command that runs the call's child confined by ``jail`` under its rlimits, and its environment
    (the tool call's here; an MCP server's, which lives on, in ``mcp_client``)."""
    limits = call.limits
    uid = os.getuid() if jail.uid is None else jail.uid
    child_limits = {**limits.model_dump(), "nproc": _nproc_limit(uid, limits.max_processes)}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
           "HOME": "/tmp"}
    if call.python_path:
        env["PYTHONPATH"] = os.pathsep.join(call.python_path)
    return _command(call, jail, child_limits), env


def run(call: Call, args: dict, jail: Jail) -> Outcome:
    """Run the call's child confined by ``jail``; returns the (capped) output or raises tool_failed."""
    limits = call.limits
    command, env = confined(call, jail)
    cap = limits.max_output_bytes
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="magtool") as cwd:
        proc = subprocess.Popen(command,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                cwd=cwd, env=env, start_new_session=True, close_fds=True)
        try:
            proc.stdin.write(json.dumps(args).encode())
            proc.stdin.close()
        except BrokenPipeError:
            pass  # a command that does not read stdin may have exited already
        out, err, truncated, timed_out = bytearray(), bytearray(), False, False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        deadline = started + limits.timeout_s
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    buf = key.data
                    room = (cap + 1 if buf is out else _STDERR_CAP) - len(buf)
                    buf += chunk[:max(room, 0)]
                    if buf is out and len(out) > cap:
                        truncated = True
                        break
                if truncated:
                    break
        finally:
            sel.close()
            if timed_out or truncated:
                _kill_everything(proc, jail.namespaced)
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                _kill_everything(proc, jail.namespaced)
                proc.wait()
                timed_out = True
            _kill_everything(proc, jail.namespaced)  # what the tool left running goes too
            proc.stdout.close()
            proc.stderr.close()
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    if truncated:
        kept = bytes(out[:cap]).decode("utf-8", errors="replace")
        return Outcome(f"{kept}\n[output truncated: the tool wrote more than {cap} bytes and was stopped]",
                       True, elapsed_ms)
    if timed_out:
        raise tool_failed("timeout", f"no result within {limits.timeout_s:g} s; the tool and every process "
                                     "it started were killed")
    if proc.returncode != 0:
        raise _failure(proc.returncode, err.decode("utf-8", errors="replace"), limits)
    return Outcome(bytes(out).decode("utf-8", errors="replace"), False, elapsed_ms)
