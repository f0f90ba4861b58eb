"""Is a service up? One ``health`` request with a short timeout: for the launcher, the watchdog,
``magnitude health`` and ``scripts/ops/health`` (the compose healthcheck, run every 15 s in every container, so
this module stays light: no model runtime, no user-facing package)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config


@dataclass
class ServiceStatus:
    name: str
    healthy: bool
    detail: dict
    error: str | None = None


def probe(config: Config, name: str, timeout_s: float = 5.0) -> ServiceStatus:
    try:
        with Client.for_service(name, config, timeout_s=timeout_s) as client:
            detail = client.health()
        return ServiceStatus(name, bool(detail.get("ok")), detail)
    except ServiceError as err:
        return ServiceStatus(name, False, {}, f"{err.code}: {err.message}")


def print_statuses(statuses: list[ServiceStatus], as_json: bool) -> int:
    """One line per service (or JSON); the exit code: 0 only if every one is healthy."""
    if as_json:
        print(json.dumps([{"service": s.name, "healthy": s.healthy, "error": s.error, **s.detail}
                          for s in statuses], indent=2))
    else:
        for s in statuses:
            if s.healthy:
                d = s.detail
                extra = f" model={d['model']}" if "model" in d else ""
                extra += f" restarts={d['restarts']}" if "restarts" in d else ""
                extra += " mcp=" + ",".join(f"{n}:{m['state']}" for n, m in d["mcp"].items()) if d.get("mcp") else ""
                print(f"{s.name:<12} healthy  pid={d.get('pid')} uptime={d.get('uptime_s')}s "
                      f"rss={d.get('rss_mb')}MB queue={d.get('queue_depth')}{extra}")
            else:
                print(f"{s.name:<12} UNHEALTHY {s.error}")
    return 0 if statuses and all(s.healthy for s in statuses) else 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--service", action="append", choices=(*SERVICE_NAMES, WATCHDOG_NAME),
                        help="only this service (repeatable; default: every service and the watchdog)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per service (default 5)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
