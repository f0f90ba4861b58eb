"""Where a python/shell tool's process runs: a bubblewrap sandbox when bwrap works here, else bare with rlimits.

Under bubblewrap (``bwrap``, Debian package ``bubblewrap``) a tool gets its own
PID, IPC, UTS and network namespaces and a filesystem made of read-only binds:
the system (/usr, /etc), the Python runtime, the tool's declared ``roots`` (and
for a python tool its import path), and an empty /tmp. The data directory, the
CURVE keys, the ipc sockets and the databases are covered by empty mounts
wherever they would otherwise show, so a tool reads none of them even when a
root contains them (a root *inside* the data directory stays visible: it was
declared). /proc, /sys and /dev are the sandbox's own (its PID namespace's
/proc, a minimal /dev, an empty /sys) even under a root "/": the host's would
show the service's environment (MCP header secrets) and shared memory. Without
``network: true`` the tool has no network at all. bwrap runs with
``--die-with-parent`` and is the PID namespace's init, so killing it kills
everything the tool started, ``setsid`` and double forks included.

When the service runs as root, the sandboxed child drops to ``agent.tool_uid``
(nobody by default) before it runs the tool: a tool is never root, so
``RLIMIT_NPROC`` binds it and root-only files stay closed. bwrap is given
CAP_SETUID/CAP_SETGID for that drop only; the child loses every capability with
it, and bwrap's no-new-privileges keeps setuid binaries inert. (The binds are
what make the drop work: bare, the interpreter may live where that uid cannot
read, e.g. under /root.)

In a container bwrap needs a seccomp profile that allows namespaces (Docker's
default refuses them: compose.yaml gives the tools container
docker/seccomp-tools.json), and there a tool's /proc is empty (see ``_probe``).

Where bwrap is missing or cannot create namespaces (a container without user
namespaces or such a profile), ``tool_isolation: auto`` falls back to rlimits and a kill of the
process group and its descendants, under the service's own uid, and says so in
the log (``tool_isolation`` at start); ``tool_isolation: bubblewrap`` refuses to
start where anything would run in the jail (a python or shell tool, a stdio MCP server). With nothing to
confine (the built-in tools run in the service itself) it starts and says why bwrap cannot run: that is the
tools service under Docker Swarm, whose services get no seccomp profile here (docs/fleet.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

from shared.config import Config, ConfigError

_SYSTEM_DIRS = ("/usr", "/etc")
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_PROBE_TIMEOUT_S = 10.0


def _real(path: str | Path) -> Path:
    return Path(os.path.realpath(path))


#: Kernel interfaces no tool reads, whatever its roots: the service's /proc/self/environ holds MCP header secrets,
#: /proc/PID/mem any process's memory, /dev/shm the prompts in flight. A sandbox gets its own instead.
KERNEL_PATHS = (Path("/proc"), Path("/sys"), Path("/dev"))


def under(path: Path, parent: Path) -> bool:
    return path == parent or parent in path.parents


def private_paths(config: Config) -> list[Path]:
    """What no tool may read: the data directory, the keys, the ipc sockets, the databases and the strategy."""
    runtime = config.runtime
    data_dir = runtime.resolved_data_dir()
    return [_real(p) for p in (data_dir, runtime.resolved_keys_dir(), runtime.run_dir(),
                               config.memory.db_path or data_dir / "memory.db",
                               config.optimizer.strategy_path or data_dir / "strategy.json")]


def shown_from_outside(path: Path, roots: list[Path]) -> bool:
    """Whether one of ``roots`` shows ``path`` without being declared inside it: then ``path`` is covered."""
    return any(under(path, r) and not under(r, path) for r in roots)


def _namespace_flags(network: bool) -> list[str]:
    flags = ["--unshare-ipc", "--unshare-pid", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        flags.append("--unshare-net")
    if os.geteuid() != 0:
        flags.append("--unshare-user")  # an unprivileged bwrap needs a user namespace for the others
    return flags + ["--die-with-parent", "--new-session"]


def _private_tmp(size_mb: int) -> list[str]:
    """An empty, size-capped /tmp that any uid may write (the tool's working directory)."""
    return ["--perms", "1777", "--size", str(size_mb << 20), "--tmpfs", "/tmp", "--chdir", "/tmp"]


#: A tool's /proc: its own PID namespace's; where no procfs may be mounted, an empty one.
_OWN_PROC = ("--proc", "/proc")
_EMPTY_PROC = ("--tmpfs", "/proc")


def _probe(bwrap: str) -> tuple[tuple[str, ...] | None, str]:
    """The /proc a sandbox can have here and "", or None and why bwrap cannot sandbox here.

    In a container whose /proc has masked paths (Docker's default) the kernel refuses a fresh procfs to a user
    namespace; binding the container's /proc instead would show processes outside the sandbox (and through
    /proc/PID/root, their files), so there a tool gets an empty /proc."""
    why = ""
    for proc in (_OWN_PROC, _EMPTY_PROC):
        try:
            done = subprocess.run([bwrap, *_namespace_flags(False), "--ro-bind", "/", "/", *proc, *_private_tmp(1),
                                   "--", "true"], capture_output=True, timeout=_PROBE_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"{bwrap} did not run: {exc}"
        if done.returncode == 0:
            return proc, ""
        why = f"{bwrap} cannot create namespaces here: {done.stderr.decode(errors='replace').strip()[:300]}"
    return None, why


def jailed_work(config: Config) -> str:
    """What this configuration runs in the jail, in words ("" for nothing: built-in tools run in the service)."""
    tools = [t.name for t in config.agent.tools if t.kind in ("python", "shell")]
    servers = [s.name for s in config.agent.mcp_servers if s.command]
    return " and ".join(part for part in (f"tools {', '.join(tools)}" if tools else "",
                                          f"MCP servers {', '.join(servers)}" if servers else "") if part)


class Jail:
    """How this tool service confines its children; ``wrap`` turns a child command into the confined one."""

    def __init__(self, config: Config):
        mode = config.agent.tool_isolation
        self.bwrap: str | None = None
        self.proc: tuple[str, ...] = ()
        self.reason = "agent.tool_isolation is off"
        if mode != "off":
            found = shutil.which("bwrap")
            proc, self.reason = _probe(found) if found else (None, "bwrap is not installed (Debian package "
                                                                   "bubblewrap)")
            self.bwrap, self.proc = (found, proc) if proc else (None, ())
            if mode == "bubblewrap" and self.bwrap is None and (confined := jailed_work(config)):
                raise ConfigError(f"agent.tool_isolation is bubblewrap and {confined} would run without it: "
                                  f"{self.reason}")
        #: The uid the child drops to (None: it keeps the service's).
        self.uid: int | None = config.agent.tool_uid if self.bwrap and os.geteuid() == 0 else None
        #: Never shown to a tool: directories get an empty tmpfs over them, files /dev/null.
        self.private = private_paths(config)
        # The interpreter inside: the venv's own bin/python (so the venv is found), by its real path.
        venv_python = _real(sys.prefix) / "bin" / Path(sys.executable).name
        self.python = str(venv_python if venv_python.exists() else _real(sys.executable))

    @property
    def namespaced(self) -> bool:
        """Killing the child kills everything it started (the PID namespace goes with its init)."""
        return self.bwrap is not None

    def describe(self) -> dict:
        if self.bwrap is None:
            return {"isolation": "rlimits", "tool_uid": self.uid, "why": self.reason}
        return {"isolation": "bubblewrap", "tool_uid": self.uid, "proc": "own" if self.proc == _OWN_PROC else "empty"}

    def runtime_paths(self) -> list[Path]:
        """What the interpreter itself needs: its installation and the venv."""
        return [_real(p) for p in {sys.base_prefix, sys.prefix, sys.exec_prefix}]

    def wrap(self, child: list[str], *, visible: list[Path], roots: list[Path], network: bool,
             tmp_mb: int) -> list[str]:
        """The command that runs ``child`` confined: ``visible`` and ``roots`` read-only, private paths masked.

        ``visible`` is what the child needs to run (runtime, child script, import path); ``roots`` are
        what the tool declared, bound after the masks so a declared root inside the data directory shows.
        """
        if self.bwrap is None:
            return child
        args = [self.bwrap, *_namespace_flags(network)]
        if self.uid is not None:
            args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]  # for the child's drop to tool_uid
        for path in _SYSTEM_DIRS:
            args += ["--ro-bind", path, path]
        for link in _SYSTEM_LINKS:
            if os.path.islink(link):
                args += ["--symlink", os.readlink(link), link]
            elif os.path.isdir(link):
                args += ["--ro-bind", link, link]
        args += [*self.proc, "--dev", "/dev", *_private_tmp(tmp_mb)]
        bound = [Path(p) for p in _SYSTEM_DIRS]
        args += self._binds(visible, bound)
        args += self._masks(lambda path: any(under(path, b) for b in bound))
        real_roots = [_real(r) for r in roots if os.path.exists(r)]
        args += self._binds(real_roots, bound)
        # A root that contains a private path shows it only when the root was declared inside it.
        args += self._masks(lambda path: shown_from_outside(path, real_roots))
        return args + self._kernel_covers(real_roots) + ["--", *child]

    @staticmethod
    def _binds(paths: list[Path], bound: list[Path]) -> list[str]:
        """Read-only binds of ``paths`` not already visible, with their parent folders made traversable
        (bwrap would create them 0700, closed to the tool's uid)."""
        args: list[str] = []
        for path in sorted({_real(p) for p in paths if os.path.exists(p)}, key=lambda p: len(p.parts)):
            if any(under(path, b) for b in bound):
                continue
            for parent in reversed(path.parents):  # --dir leaves an existing folder as it is
                if parent != Path("/") and not any(under(parent, Path(s)) for s in _SYSTEM_DIRS):
                    args += ["--dir", str(parent)]
            args += ["--ro-bind", str(path), str(path)]
            bound.append(path)
        return args

    def _kernel_covers(self, roots: list[Path]) -> list[str]:
        """The sandbox's own /proc, /dev and an empty /sys over the host's that a root shows (root "/") or lies in
        (bwrap binds recursively, so a bound "/" brings the host's /proc with it)."""
        cover = {"/proc": list(self.proc), "/dev": ["--dev", "/dev"], "/sys": ["--tmpfs", "/sys"]}
        return [arg for path in KERNEL_PATHS if any(under(path, r) or under(r, path) for r in roots)
                for arg in cover[str(path)]]

    def _masks(self, shown: Callable[[Path], bool]) -> list[str]:
        """Cover each existing private path that ``shown`` says the binds so far would show."""
        args: list[str] = []
        for path in self.private:
            if os.path.exists(path) and shown(path):
                args += ["--tmpfs", str(path)] if path.is_dir() else ["--ro-bind", "/dev/null", str(path)]
        return args
