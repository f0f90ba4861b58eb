"""What every config section shares: the base model, the error type, names of the processes, the home folder."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

#: Service processes the launcher starts, in start order; the watchdog supervises exactly these.
SERVICE_NAMES = ("inference", "embedding", "retrieval", "tools", "optimizer", "gateway")
#: The supervising process: started after the services, stopped before them, never supervised itself.
WATCHDOG_NAME = "watchdog"


def magnitude_home() -> Path:
    """Root for models, data and runtime files (``MAGNITUDE_HOME``, default ``~/.cache/magnitude``)."""
    return Path(os.environ.get("MAGNITUDE_HOME") or Path.home() / ".cache" / "magnitude")


class ConfigError(ValueError):
    """A configuration file that cannot be used, with one line per problem."""


def require_known_services(names, known: tuple[str, ...] = SERVICE_NAMES) -> None:
    for name in names:
        if name not in known:
            raise ValueError(f"unknown service {name!r} (known: {', '.join(known)})")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def error_lines(err: ValidationError) -> list[str]:
    """One line per problem: where, what, and the value given (every config and settings error reads alike)."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        got = e.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"{where}: {e['msg']}{got_text}")
    return lines
