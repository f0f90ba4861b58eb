"""The sandboxed side of a tool call: ``python -m services.tools.child SPEC_JSON``, args as JSON on stdin.

It sets its own rlimits first (so the parent, which has threads, needs no
``preexec_fn``), drops to the tools' uid when it was started as root (after the
rlimits, so RLIMIT_NPROC counts that uid's processes and binds), then either runs
a Python function and prints its result, or ``exec``s a command in its place.
Exit codes tell the parent what went wrong.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import resource
import sys

EXIT_RAISED = 3
EXIT_MEMORY = 4


def _set_limits(limits: dict) -> None:
    mb = 1 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if limits.get("nproc") is not None:
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["nproc"],) * 2)


def _drop_privileges(uid: int | None) -> None:
    """Become ``uid`` (and gid) with no supplementary groups; as root, every capability goes with it."""
    if uid is None:
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit(f"could not drop to uid {uid}")


def _load(target: str):
    module_name, func_name = target.rsplit(":", 1)
    if module_name.endswith(".py"):
        spec = importlib.util.spec_from_file_location("magnitude_tool", module_name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    return getattr(module, func_name)


def main() -> None:
    sys.path.pop(0)  # this folder: its modules must not shadow what a tool imports
    spec = json.loads(sys.argv[1])
    _set_limits(spec["limits"])
    _drop_privileges(spec.get("uid"))
    if "argv" in spec:
        os.execvp(spec["argv"][0], spec["argv"])  # raises OSError (-> exit 1 with a traceback) if missing
    args = json.loads(sys.stdin.read())
    try:
        result = _load(spec["python"])(**args)
    except MemoryError:
        sys.stderr.write("MemoryError: the tool exceeded its memory limit\n")
        sys.exit(EXIT_MEMORY)
    except BaseException as exc:  # the tool's own failure, reported to the agent
        sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
        sys.exit(EXIT_RAISED)
    if result is not None:
        sys.stdout.write(result if isinstance(result, str) else json.dumps(result, default=str))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
