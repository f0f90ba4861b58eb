"""Structured JSON logs for every process, one event per line on stderr.

Two bounds keep a log from filling the disk (issue 34: a client that provoked RecursionErrors wrote ~300 KB
of traceback a request, to a file appended forever). A traceback is capped at ``MAX_EXCEPTION_CHARS``: its
first frames (where it started) and its last (how it ended). And a process that ``shared.process.spawn``
started rotates its log file by size (``rotation_env``): everything written to its stderr, llama.cpp's C
prints and crash tracebacks included, follows the new file. Standard-library logging (uvicorn's "Exception in
ASGI application", asyncio's) goes through the same pipeline, so its tracebacks are capped too.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import TextIO, cast

import structlog
from structlog.typing import EventDict, WrappedLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: The most characters of a traceback one event carries: half from its start, half from its end.
MAX_EXCEPTION_CHARS = 8192
#: Set by ``shared.process.spawn``: the log file the process's stderr appends to, and when to rotate it.
LOG_ENV = "MAGNITUDE_LOG"


_configured = False


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """A logger bound to ``service``. The processor pipeline is set by the first call of the process only,
    so a second component in the same process (a test, an embedded service) cannot reconfigure the first's."""
    global _configured
    if not _configured:
        _configure(level)
        _configured = True
    return structlog.get_logger().bind(service=service)


def rotation_env(path: Path, max_bytes: int, backups: int) -> dict[str, str]:
    """The environment that makes a process whose stderr appends to ``path`` rotate it past ``max_bytes``."""
    return {LOG_ENV: json.dumps({"path": str(path), "max_bytes": max_bytes, "backups": backups})}


def _configure(level: str) -> None:
    # Taken out of the environment, so that a process this one starts does not rotate the same file too.
    rotation = os.environ.pop(LOG_ENV, None)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _cap_exception,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # PrintLogger only writes to and flushes its file, all that _RotatingStderr has of a TextIO
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, _RotatingStderr.of(rotation)) or sys.stderr),
        cache_logger_on_first_use=True,
    )
    logging.getLogger().addHandler(_Forward())


def _cap_exception(logger: WrappedLogger, method: str, event: EventDict) -> EventDict:
    """A traceback over ``MAX_EXCEPTION_CHARS`` keeps its start and its end. A RecursionError's is ~300 KB of
    the same frames, and a client that can provoke one must not be able to fill the disk with them."""
    text = event.get("exception")
    if isinstance(text, str) and len(text) > MAX_EXCEPTION_CHARS:
        half = MAX_EXCEPTION_CHARS // 2
        event["exception"] = f"{text[:half]}\n... {len(text) - 2 * half} characters cut ...\n{text[-half:]}"
    return event


class _Forward(logging.Handler):
    """A standard-library record (WARNING and up, the root logger's default level) as a structlog event: one
    JSON line like every other, its traceback capped. Without it uvicorn printed a whole traceback as text."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger().log(record.levelno, record.getMessage(), logger=record.name,
                                   exc_info=record.exc_info or False)


class _RotatingStderr:
    """stderr, whose file is renamed ``path.1`` (older ones shifted up to ``path.<backups>``, the oldest
    dropped) once it passes ``max_bytes``, and a new ``path`` put on fd 2 (and fd 1 when it is the same file).
    Everything that writes to those descriptors follows; one ``fstat`` after each event measures what all
    of them wrote, so a file passes the limit by one event and what C code wrote since the last one."""

    def __init__(self, path: str, max_bytes: int, backups: int, fds: list[int]):
        self.stream, self.path, self.max_bytes, self.backups, self.fds = sys.stderr, path, max_bytes, backups, fds

    @classmethod
    def of(cls, rotation: str | None) -> _RotatingStderr | None:
        """From ``LOG_ENV``'s value; None when there is none, or when fd 2 is not the file it names (the
        process was started some other way)."""
        if not rotation:
            return None
        spec = json.loads(rotation)
        try:
            log = os.stat(spec["path"])
            fds = [fd for fd in (1, 2) if os.path.samestat(os.fstat(fd), log)]
        except OSError:
            return None
        return cls(spec["path"], spec["max_bytes"], spec["backups"], fds) if 2 in fds else None

    def write(self, text: str) -> int:
        return self.stream.write(text)

    def flush(self) -> None:
        """Called once per event (structlog's PrintLogger, under its lock)."""
        self.stream.flush()
        if os.fstat(2).st_size > self.max_bytes:
            try:
                self._rotate()
            except OSError:  # a full disk, a removed run directory: logging goes on where it is, retried next event
                pass

    def _rotate(self) -> None:
        for n in range(self.backups - 1, 0, -1):  # path.<backups-1> replaces the oldest first, path.1 last
            if os.path.exists(f"{self.path}.{n}"):
                os.replace(f"{self.path}.{n}", f"{self.path}.{n + 1}")
        if self.backups:
            os.replace(self.path, f"{self.path}.1")
        else:
            os.unlink(self.path)
        sys.stdout.flush()
        fresh = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        for fd in self.fds:
            os.dup2(fresh, fd)
        os.close(fresh)
