"""The watchdog's decisions: one heartbeat per service per interval, and what to do about what it sees.

- process gone                                  -> start it again ("dead")
- alive, but its ipc socket is gone              -> SIGKILL and start ("unreachable": no client can reach it)
- alive, but ``hung_checks`` heartbeats failed   -> SIGKILL and start ("hung")
- (re)started but silent past ``start_timeout_s`` -> SIGKILL and start ("start_timeout")
- says it is stopping (SIGTERM: it drains, saves) -> left to exit for ``runtime.stop_timeout_s``, its socket
                                                   closing meanwhile; then it is dead, or hung if still there
- memory above its ceiling                       -> graceful restart, it drains first ("memory")

Restarts back off: the first is immediate, each further one waits after the
previous (1 s, doubling up to 60 s by default), and a service that stayed
healthy ``backoff_reset_s`` starts over with an immediate restart. So a service
that crashes at start never becomes a hot loop. Log lines about a supervised
service carry its name as ``service``.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import psutil

from services.watchdog.backends import Backend
from services.watchdog.priority import allowed_cpus, big_cores
from shared.config import SERVICE_NAMES, Config
from shared import health
from shared.protocol import ErrorCode

#: The service whose priority and cores the watchdog raises.
PRIORITY_SERVICE = "inference"

Probe = Callable[[str], health.ServiceStatus]


@dataclass
class ServiceState:
    """What the watchdog knows about one supervised service (``watchdog.status`` reports these fields)."""

    state: str = "unknown"  # starting | healthy | unhealthy | stopping | dead | backoff
    pid: int | None = None
    restarts: int = 0
    attempt: int = 0  # restarts since the service was last healthy for backoff_reset_s
    last_reason: str | None = None
    last_restart_at: float | None = None  # unix time
    backoff_s: float = 0.0  # the next restart waits this long after the last one
    failed_checks: int = 0
    rss_mb: float | None = None
    # monotonic bookkeeping, not reported
    started_mono: float = 0.0
    healthy_since: float | None = None
    stopping_since: float | None = None
    next_restart_mono: float = 0.0
    prioritized_pid: int | None = None

    def report(self) -> dict[str, Any]:
        public = {k: v for k, v in asdict(self).items()
                  if k not in ("started_mono", "healthy_since", "stopping_since", "next_restart_mono",
                               "prioritized_pid")}
        public["rss_mb"] = None if self.rss_mb is None else round(self.rss_mb, 1)
        return public


class Supervisor:
    def __init__(self, config: Config, backend: Backend, log: Any, probe: Probe | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 on_restart: Callable[[str, str], None] = lambda service, reason: None):
        self.cfg = config.watchdog
        self.stop_timeout_s = config.runtime.stop_timeout_s()  # what a stopping service is given to exit
        self.backend = backend
        self.log = log
        self.on_restart = on_restart  # (service, reason): e.g. a metrics counter
        self.clock = clock
        self.probe = probe or (lambda name: health.probe(config, name, timeout_s=self.cfg.health_timeout_s))
        self.states = {name: ServiceState() for name in SERVICE_NAMES}
        self._reports = {name: s.report() for name, s in self.states.items()}
        self._warned: set[str] = set()
        self.cores, why = (big_cores(self.cfg.sysfs_root, allowed_cpus()) if self.cfg.pin_inference
                           else (None, "watchdog.pin_inference is off"))
        self.log.info("inference_cores", pin=sorted(self.cores) if self.cores else None, reason=why)

    # --- reporting (read by the service thread while the supervisor thread writes) -------
    def status(self) -> dict[str, Any]:
        services = dict(self._reports)
        return {"backend": self.backend.kind, "interval_s": self.cfg.interval_s,
                "restarts": self.total_restarts(), "services": services}

    def total_restarts(self) -> int:
        return sum(s.restarts for s in self.states.values())

    def ceiling_mb(self, name: str) -> float:
        """Per-service ceiling, else the common one, else 75% of physical memory."""
        explicit = self.cfg.service_memory_ceiling_mb.get(name, self.cfg.memory_ceiling_mb)
        return explicit if explicit is not None else 0.75 * psutil.virtual_memory().total / 2**20

    # --- the loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Heartbeat every service each ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            self.tick()
            stop.wait(self.cfg.interval_s)

    def tick(self) -> None:
        for name, state in self.states.items():
            try:
                self.check(name, state)
            except Exception as exc:  # one service's odd failure must not stop supervising the rest
                self.log.error("watchdog_check_failed", service=name, error=f"{type(exc).__name__}: {exc}")
            self._reports[name] = state.report()

    def check(self, name: str, s: ServiceState) -> None:
        now = self.clock()
        pid = self.backend.pid(name)
        if pid is None:
            s.state, s.pid = "dead", None
            if not self.backend.replaces_exited:  # else the platform (Swarm) brings it back: never fight it
                self._restart(name, s, "dead", now)
            return
        if pid != s.pid:  # first sight, or restarted by someone else (docker's restart policy, a user)
            s.pid, s.state, s.started_mono, s.failed_checks, s.healthy_since = pid, "starting", now, 0, None
            s.stopping_since = None
        status = self.probe(name)
        if status.detail.get("stopping"):
            if s.stopping_since is None:
                s.stopping_since = now
                self.log.info("service_stopping", service=name, pid=pid)
            s.state = "stopping"
        if s.stopping_since is not None:  # it drains and saves, then exits (its socket goes first)
            if now - s.stopping_since > self.stop_timeout_s:
                self._restart(name, s, "hung", now)  # still there long after it was told to stop
            return
        if status.healthy:
            self._on_healthy(name, s, now)
        elif s.state == "starting":
            if now - s.started_mono > self.cfg.start_timeout_s:
                self._restart(name, s, "start_timeout", now)
        elif (status.error or "").startswith(ErrorCode.UNAVAILABLE):
            # A killed process's socket goes before the process is reaped: look again before blaming the socket.
            if self.backend.pid(name) is None:
                s.state, s.pid = "dead", None
                self._restart(name, s, "dead", now)
            else:
                self._restart(name, s, "unreachable", now)
        else:
            s.failed_checks += 1
            s.state = "unhealthy"
            self.log.warning("heartbeat_failed", service=name, pid=pid, failed_checks=s.failed_checks,
                             error=status.error)
            if s.failed_checks >= self.cfg.hung_checks:
                self._restart(name, s, "hung", now)

    def _on_healthy(self, name: str, s: ServiceState, now: float) -> None:
        if s.healthy_since is None:
            s.healthy_since = now
        s.state, s.failed_checks = "healthy", 0
        if s.attempt and now - s.healthy_since >= self.cfg.backoff_reset_s:
            s.attempt, s.backoff_s, s.next_restart_mono = 0, 0.0, 0.0
        if name == PRIORITY_SERVICE and s.prioritized_pid != s.pid:
            self._prioritize(name)  # after it is up, so the threads it made at start get it too
            s.prioritized_pid = s.pid
        s.rss_mb = self.backend.memory_mb(name)
        ceiling = self.ceiling_mb(name)
        if s.rss_mb is not None and s.rss_mb > ceiling:
            self.log.warning("memory_ceiling_exceeded", service=name, rss_mb=round(s.rss_mb, 1), ceiling_mb=ceiling)
            self._restart(name, s, "memory", now)

    def _restart(self, name: str, s: ServiceState, reason: str, now: float) -> None:
        if now < s.next_restart_mono:
            s.state = "backoff"
            return
        running = s.pid is not None
        try:
            if running:
                self.backend.restart(name, hard=reason != "memory")  # only a healthy process can drain
            else:
                self.backend.start(name)
        finally:  # a failed attempt backs off like a successful one
            s.restarts += 1
            s.attempt += 1
            s.last_reason = reason
            s.last_restart_at = time.time()
            s.backoff_s = (self.cfg.backoff_initial_s if s.attempt == 1
                           else min(s.backoff_s * 2, self.cfg.backoff_max_s))
            s.next_restart_mono = now + s.backoff_s
            s.state, s.started_mono, s.failed_checks, s.healthy_since = "starting", self.clock(), 0, None
            s.stopping_since = None
        s.pid = self.backend.pid(name)
        self.on_restart(name, reason)
        self.log.info("service_restarted", service=name, reason=reason, attempt=s.attempt, pid=s.pid,
                      restarts=s.restarts, backoff_s=s.backoff_s)

    def _prioritize(self, name: str) -> None:
        """Nice and big cores for the inference process; each refusal is logged once, then tolerated."""
        actions = [("nice", lambda: self.backend.set_nice(name, self.cfg.inference_nice))]
        if self.cores:
            actions.append(("pin", lambda: self.backend.pin(name, self.cores)))
        for what, action in actions:
            try:
                action()
                self.log.info("inference_prioritized", action=what, nice=self.cfg.inference_nice,
                              cores=sorted(self.cores) if self.cores else None)
            except (OSError, NotImplementedError) as err:
                if what not in self._warned:
                    self._warned.add(what)
                    self.log.warning("inference_priority_not_applied", action=what, error=str(err))
