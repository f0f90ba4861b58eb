"""Built-in tools: a safe calculator, a confined read-only file reader, and memory search.

They run in the service process because they cannot run away: the calculator
bounds every number it builds, the file reader reads at most a capped number of
bytes from a regular file under a configured root, and memory search is one
request with a timeout. The file reader runs unsandboxed, so it hides what the
sandbox hides (``jail.private_paths``) by the same rule: a root shows the data
directory, keys, sockets and databases only when it was declared inside them;
and /proc, /sys and /dev (``jail.KERNEL_PATHS``) never.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

from shared.client import Client, ServiceError
from services.tools import beneath
from services.tools.errors import tool_failed
from services.tools.jail import KERNEL_PATHS, private_paths, shown_from_outside, under
from shared.arithmetic import evaluate
from shared.config import Config
from shared.protocol import ErrorCode

SCHEMAS: dict[str, dict[str, Any]] = {
    "calculator": {
        "type": "object",
        "properties": {"expression": {"type": "string", "minLength": 1, "maxLength": 120,
                                      "description": "arithmetic on the numbers of the task, e.g. 12 * (3.5 + 4) / 2, 2 ** 10, sqrt(2)"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
    "file_reader": {
        "type": "object",
        "properties": {"path": {"type": "string", "minLength": 1, "maxLength": 200,
                                "description": "file path, relative to the first root or absolute under a root"}},
        "required": ["path"],
        "additionalProperties": False,
    },
    "memory_search": {
        "type": "object",
        "properties": {"query": {"type": "string", "minLength": 1, "maxLength": 200},
                       "k": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query"],
        "additionalProperties": False,
    },
}

DESCRIPTIONS = {
    "calculator": "Evaluate an arithmetic expression exactly. Use it for every calculation; it knows no facts.",
    "file_reader": "Read a text file by its path. Use it whenever the task names a file.",
    "memory_search": "Search long-term memory for notes related to a query. Not for files.",
}

# --- calculator --------------------------------------------------------------------------------
def calculate(expression: str) -> str:
    """The calculator tool: ``shared.arithmetic`` (no ``eval``), its failures as the tool's."""
    try:
        return str(evaluate(expression))
    except SyntaxError:
        raise tool_failed("refused", f"not an arithmetic expression: {expression!r}")
    except (ValueError, ArithmeticError, TypeError) as exc:
        raise tool_failed("raised", f"{type(exc).__name__}: {exc}")


# --- file_reader -------------------------------------------------------------------------------
#: Why ``beneath.open_beneath`` failed, for the refusal (errno to the words after the path).
_OPEN_REFUSALS = {
    errno.ENOENT: "no such file",
    errno.ENOTDIR: "a component of the path is not a directory",
    errno.ELOOP: "the path is or passes through a symlink, and file_reader follows none",
    errno.EXDEV: "the path leads outside its root",
    errno.EACCES: "permission denied",
    errno.ENXIO: "not a regular file",
    errno.ENAMETOOLONG: "the name is too long",
}


def read_file(path_text: str, roots: list[Path], max_file_bytes: int, private: list[Path]) -> str:
    """Read a regular file under a root, opened beneath the root's directory fd with no symlink followed in any
    component (``beneath``: checking a resolved path and then opening it races a swap), never in /proc, /sys,
    /dev or a ``private`` path the roots show; capped size. Every refusal is a typed ``refused``."""
    if not roots:
        raise tool_failed("refused", "file_reader has no configured roots (agent.file_roots)")
    if "\0" in path_text:  # the kernel would read the name only up to it
        raise tool_failed("refused", f"path {path_text!r} contains a NUL byte")
    path = Path(path_text)
    if ".." in path.parts:
        raise tool_failed("refused", f"path {path_text!r} contains '..'")
    real_roots = [Path(os.path.realpath(r)) for r in roots]
    root, rel = _locate(path, roots, real_roots)
    target = root / rel  # the file's real path: the open follows no symlink and no '..'
    if any(under(target, k) for k in KERNEL_PATHS):
        raise tool_failed("refused", f"path {path_text!r} is in /proc, /sys or /dev, which file_reader never reads")
    if any(under(target, p) and shown_from_outside(p, real_roots) for p in private):
        raise tool_failed("refused", f"path {path_text!r} is in Magnitude's private data (data directory, keys, "
                                     "sockets, databases)")
    fd = _open(root, rel, path_text)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise tool_failed("refused", f"{path_text!r} is not a regular file")
        if st.st_size > max_file_bytes:
            raise tool_failed("refused", f"{path_text!r} is {st.st_size} bytes; the limit is {max_file_bytes}")
        data = os.read(fd, max_file_bytes)
    except OSError as exc:
        raise tool_failed("refused", f"cannot read {path_text!r}: {exc.strerror}")
    finally:
        os.close(fd)
    return data.decode("utf-8", errors="replace")


def _locate(path: Path, roots: list[Path], real_roots: list[Path]) -> tuple[Path, Path]:
    """The real root a path lies under and the path relative to it: a relative path is the first root's."""
    if not path.is_absolute():
        return real_roots[0], path
    for given, real in zip(roots, real_roots):
        for form in (Path(os.path.abspath(given)), real):
            if under(path, form):
                return real, path.relative_to(form)
    raise tool_failed("refused", f"path {str(path)!r} is outside the allowed roots")


def _open(root: Path, rel: Path, path_text: str) -> int:
    """The file's fd, opened beneath ``root``; O_NONBLOCK: opening a FIFO must not hang."""
    try:
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise tool_failed("refused", f"cannot open the root of {path_text!r}: {exc.strerror}")
    try:
        return beneath.open_beneath(root_fd, str(rel), os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise tool_failed("refused", f"cannot open {path_text!r}: "
                                     f"{_OPEN_REFUSALS.get(exc.errno or 0, exc.strerror)}")
    except ValueError:  # a name the file system cannot encode (a lone surrogate)
        raise tool_failed("refused", f"path {path_text!r} is not a valid file name")
    finally:
        os.close(root_fd)


# --- memory_search -----------------------------------------------------------------------------
def search_memory(config: Config, query: str, k: int = 3) -> str:
    """Ask the retrieval service; its absence is a typed ``unavailable`` failure, not a crash."""
    try:
        with Client.for_service("retrieval", config, timeout_s=10.0) as client:
            body = client.request("memory.query", {"collection": config.agent.memory_collection,
                                                   "text": query, "k": k})
    except ServiceError as err:
        if err.code in (ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT):
            raise tool_failed("unavailable", f"retrieval service unavailable ({err.message})")
        raise tool_failed("raised", f"retrieval answered {err.code}: {err.message}")
    hits = body.get("hits") or []
    if not hits:
        return "no memories found"
    return "\n".join(f"- {h.get('text', '')} (score {h.get('score', 0):.2f})" for h in hits)


def run_builtin(name: str, args: dict[str, Any], config: Config) -> str:
    if name == "calculator":
        return calculate(args["expression"])
    if name == "file_reader":
        return read_file(args["path"], config.agent.file_roots, config.agent.max_file_bytes, private_paths(config))
    if name == "memory_search":
        return search_memory(config, args["query"], args.get("k", 3))
    raise AssertionError(f"config validation lets only known builtins through, got {name!r}")
