"""Run one python/shell tool call in a subprocess it cannot escape from by running long, big or loud.

Limits: rlimits set by the child itself (address space, CPU seconds, file size,
process count), a wall-clock deadline after which the whole process group is
killed, and stdout read through a cap: once the tool has written more than
``max_output_bytes`` it is killed and what was kept comes back with a note, so
100 MB of output never sits in this process.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from services.tools.child import EXIT_MEMORY, EXIT_RAISED
from services.tools.errors import tool_failed
from shared.config import SandboxLimits

_CHILD = Path(__file__).with_name("child.py")
_STDERR_CAP = 4096


@dataclass
class Outcome:
    output: str
    truncated: bool
    elapsed_ms: float


def _nproc_limit(headroom: int) -> int | None:
    """RLIMIT_NPROC counts all of the user's processes, so the cap is today's count plus head-room."""
    uid = os.getuid()
    if uid == 0:
        return None  # not enforced for root
    mine = sum(1 for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == uid)
    return mine + headroom


def _kill_group(proc: subprocess.Popen) -> None:
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


def run(spec: dict, args: dict, limits: SandboxLimits) -> Outcome:
    """``spec`` is {"python": "mod:fn"} or {"argv": [...]}; returns the (capped) output or raises tool_failed."""
    child_limits = {**limits.model_dump(), "nproc": _nproc_limit(limits.max_processes)}
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
    cap = limits.max_output_bytes
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="magtool") as cwd:
        proc = subprocess.Popen([sys.executable, str(_CHILD), json.dumps({**spec, "limits": child_limits})],
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
                _kill_group(proc)
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                timed_out = True
            _kill_group(proc)  # grandchildren left in the group go too
            proc.stdout.close()
            proc.stderr.close()
    elapsed_ms = round((time.monotonic() - started) * 1000, 1)
    if truncated:
        kept = bytes(out[:cap]).decode("utf-8", errors="replace")
        return Outcome(f"{kept}\n[output truncated: the tool wrote more than {cap} bytes and was stopped]",
                       True, elapsed_ms)
    if timed_out:
        raise tool_failed("timeout", f"no result within {limits.timeout_s:g} s; process group killed")
    if proc.returncode != 0:
        raise _failure(proc.returncode, err.decode("utf-8", errors="replace"), limits)
    return Outcome(bytes(out).decode("utf-8", errors="replace"), False, elapsed_ms)
