"""Structured JSON logs for every process, one event per line on stderr."""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


_configured = False


def configure_logging(service: str, level: str = "info") -> structlog.stdlib.BoundLogger:
    """A logger bound to ``service``. The processor pipeline is set by the first call of the process only,
    so a second component in the same process (a test, an embedded service) cannot reconfigure the first's."""
    global _configured
    if not _configured:
        _configure(level)
        _configured = True
    return structlog.get_logger().bind(service=service)


def _configure(level: str) -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
