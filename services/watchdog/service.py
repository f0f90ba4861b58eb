"""The watchdog process: the shared service runtime (``health``, ``watchdog.status``) plus a supervisor thread.

The supervisor thread heartbeats the services; the service only answers
questions about it, so ``magnitude health`` sees the watchdog like any service.
SIGTERM stops supervising at once (``magnitude down`` stops the watchdog before
the services, so nothing it stops is restarted).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from services.watchdog.backends import choose_backend, make_backend
from services.watchdog.supervisor import Supervisor
from shared.config import WATCHDOG_NAME, Config
from shared.service import Service


class WatchdogService(Service):
    name = WATCHDOG_NAME

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        # The runner exports the config file it was given, so restarted services read the same one.
        kind, chosen_by = choose_backend(config)
        backend = make_backend(kind, config, os.environ.get("MAGNITUDE_CONFIG"))
        self.log.info("watchdog_backend", backend=kind, chosen_by=chosen_by)
        restarts = self.metrics.counter("restarts_total", "Service restarts by the watchdog.", ["service", "reason"])
        self.supervisor = Supervisor(config, backend, self.log,
                                     on_restart=lambda service, reason: restarts.labels(service, reason).inc())
        self._stop_supervising = threading.Event()
        self._thread = threading.Thread(target=self.supervisor.run, args=(self._stop_supervising,),
                                        name="watchdog-supervisor", daemon=True)
        self.handle("watchdog.status", lambda req, emit: self.supervisor.status())

    def health_details(self) -> dict[str, Any]:
        return {"backend": self.supervisor.backend.kind, "restarts": self.supervisor.total_restarts()}

    def serving(self) -> None:
        """Supervise only once this process is sure to run: a watchdog that fails its own start must not leave
        half-started services behind it."""
        self._thread.start()

    def stop(self) -> None:
        self._stop_supervising.set()  # no restart may start once we are told to stop
        super().stop()

    def close(self) -> None:
        self._stop_supervising.set()
        self._thread.join(timeout=60)  # a restart in progress (a graceful stop drains up to 30 s) completes
