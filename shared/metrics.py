"""Prometheus metrics of one service process.

Every service owns one ``ServiceMetrics`` (its own ``CollectorRegistry``, not
prometheus_client's global one, so nothing imported by accident shows up and
tests can hold several). The runtime records each final reply with
``observe_request``; the inference service adds each finished generation with
``observe_generation``. Queue depth, running jobs and uptime are read at scrape
time through callbacks, so the loop never pays for them.

The figures leave the process two ways: an HTTP server (``serve_http``; a
port in use is logged, not fatal) and ``exposition()``, which the ZeroMQ router
returns for the ``metrics`` protocol message. The HTTP server answers only
requests whose Host header names this box (loopback's names, ``metrics.host``,
``metrics.allowed_hosts``), as the gateway does: a web page that re-points its
own name at 127.0.0.1 (DNS rebinding) would otherwise read the figures.

All names start with ``magnitude_``; the ``process_*`` families (RSS, CPU
seconds, open fds) come from prometheus_client's ``ProcessCollector``.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable
from socketserver import ThreadingMixIn
from typing import Any, Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
    make_wsgi_app,
)

from shared.protocol import MESSAGES, PRIORITIES, Stats
from shared.security import allowed_host_names, host_allowed

PREFIX = "magnitude_"
#: Label for request frames that never became a known message type (bad frames, unknown types).
INVALID_TYPE = "invalid"

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10,
                    15, 20, 30, 60, 120)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 30)
_DECODE_TPS_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500)
_PREFILL_TPS_BUCKETS = (10, 25, 50, 100, 200, 400, 800, 1600, 3200, 6400, 12800)
#: Token counts of a generate result, as ``magnitude_generation_tokens_total{kind=...}``.
_TOKEN_KINDS = {"prompt": "prompt_tokens", "cached": "cached_tokens",
                "prefill": "prefill_tokens", "completion": "completion_tokens"}


class ServiceMetrics:
    """The figures every service exposes; ``counter`` adds a service's own."""

    def __init__(self, service: str, pid: int, *, queue_depth: Callable[[], float],
                 running: Callable[[], float], uptime_s: Callable[[], float]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.url: str | None = None  # set once the HTTP endpoint serves
        self._http: _Server | None = None
        ProcessCollector(registry=self.registry)
        Info(PREFIX + "service", "Which service this process is.", registry=self.registry).info(
            {"service": service, "pid": str(pid)})
        self.requests = self.counter("requests_total", "Requests answered, by message type.", ["type"])
        self.errors = self.counter("errors_total", "Error replies, by error code.", ["code"])
        self.latency = Histogram(PREFIX + "request_seconds", "Time from receipt to the final reply, by type.",
                                 ["type"], buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.deduplicated = self.counter("deduplicated_retries_total",
                                         "Retries of a running or answered request id that were not run again.")
        self._gauge("queue_depth", "Requests waiting in the bounded queue.", queue_depth)
        self._gauge("running_jobs", "Requests being worked on.", running)
        self._gauge("uptime_seconds", "Seconds since the service started.", uptime_s)

    def counter(self, name: str, documentation: str, labels: list[str] | tuple = ()) -> Counter:
        """A counter ``magnitude_<name>`` in this service's registry; samples end in ``_total`` either way."""
        return Counter(PREFIX + name, documentation, list(labels), registry=self.registry)

    def _gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        Gauge(PREFIX + name, documentation, registry=self.registry).set_function(read)

    # --- recording (cheap: a lock-protected add, no I/O) --------------------------------------
    def observe_request(self, msg_type: str, seconds: float, code: str | None = None) -> None:
        """One final reply went out: ``code`` is its error code, None for ``ok``."""
        label = msg_type if msg_type in MESSAGES else INVALID_TYPE  # bounded label values only
        self.requests.labels(label).inc()
        self.latency.labels(label).observe(seconds)
        if code is not None:
            self.errors.labels(code).inc()

    def totals(self) -> dict[str, int]:
        """Requests, errors and deduplicated retries so far, summed over labels (for ``health``)."""
        return {"requests": _sum(self.requests), "errors": _sum(self.errors),
                "deduplicated": _sum(self.deduplicated)}

    # --- exposing ----------------------------------------------------------------------------
    def exposition(self) -> dict[str, str]:
        """The ``metrics`` message reply: Prometheus text format and its content type."""
        return {"text": generate_latest(self.registry).decode(), "content_type": CONTENT_TYPE_LATEST}

    def serve_http(self, host: str, port: int, allowed_hosts: Iterable[str] = ()) -> str:
        """Serve ``/metrics`` on a daemon thread; return its URL. A request whose Host header names none of
        loopback's names, ``host`` and ``allowed_hosts`` is answered 400. Raises OSError if the port is taken."""
        app = _host_checked(make_wsgi_app(self.registry), allowed_host_names(host, allowed_hosts))
        self._http = make_server(host, port, app, _Server6 if ":" in host else _Server, handler_class=_Quiet)
        threading.Thread(target=self._http.serve_forever, name="metrics-http", daemon=True).start()
        bound_port = self._http.server_address[1]
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{bound_port}/metrics"
        return self.url

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class _Server(ThreadingMixIn, WSGIServer):
    """A thread per scrape, none of them keeping the process alive (what prometheus_client's server does, but
    serving our app: its own takes no WSGI app to wrap)."""

    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Not a line per scrape on stderr, among the JSON log lines."""


def _host_checked(app: Callable, allowed: set[str]) -> Callable:
    """The WSGI ``app``, answering 400 to a request whose Host header names none of ``allowed``."""
    def checked(environ: dict, start_response: Callable) -> Iterable[bytes]:
        if host_allowed(environ.get("HTTP_HOST", ""), allowed):
            return app(environ, start_response)
        start_response("400 Bad Request", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"the Host header names none of this endpoint's names (metrics.allowed_hosts)\n"]
    return checked


class InferenceMetrics(ServiceMetrics):
    """Adds what a generation reports: TTFT, throughput, token counts and prefix-cache use."""

    def __init__(self, service: str, pid: int, **gauges: Callable[[], float]):
        super().__init__(service, pid, **gauges)
        self.ttft = self._histogram("ttft_seconds", "Time to first token, by priority.", _TTFT_BUCKETS)
        self.decode_tps = self._histogram("decode_tokens_per_second", "Decode speed per generation, by priority.",
                                          _DECODE_TPS_BUCKETS)
        self.prefill_tps = self._histogram("prefill_tokens_per_second", "Prompt prefill speed per generation, "
                                           "by priority.", _PREFILL_TPS_BUCKETS)
        self.pauses = self.counter("generation_pauses_total", "Generations paused to give their slot to a more "
                                   "urgent request or a fairer share, by the paused one's priority.", ["priority"])
        self.tokens = self.counter("generation_tokens_total", "Tokens of finished generations, by kind: prompt, "
                                   "cached (reused from the session's KV), prefill, completion.", ["kind"])
        self.prefix_cache = self.counter("prefix_cache_requests_total", "Generations that reused cached KV "
                                         "(result=hit: cached_tokens > 0) or not (miss).", ["result"])
        for kind in _TOKEN_KINDS:  # present at zero from the start, so rate() works from the first scrape
            self.tokens.labels(kind)
        for result in ("hit", "miss"):
            self.prefix_cache.labels(result)
        for priority in PRIORITIES:
            for figure in (self.ttft, self.decode_tps, self.prefill_tps, self.pauses):
                figure.labels(priority)

    def _histogram(self, name: str, documentation: str, buckets: tuple) -> Histogram:
        return Histogram(PREFIX + name, documentation, ["priority"], buckets=buckets, registry=self.registry)

    def observe_generation(self, stats: Stats) -> None:
        """Record one finished generation from its stats."""
        priority = stats.priority
        self.ttft.labels(priority).observe(stats.ttft_s)
        if stats.decode_tps is not None:
            self.decode_tps.labels(priority).observe(stats.decode_tps)
        if stats.prefill_tps is not None:
            self.prefill_tps.labels(priority).observe(stats.prefill_tps)
        self.pauses.labels(priority).inc(stats.pauses)
        for kind, key in _TOKEN_KINDS.items():
            self.tokens.labels(kind).inc(getattr(stats, key))
        self.prefix_cache.labels("hit" if stats.cached_tokens > 0 else "miss").inc()


def metrics_for(service: str, pid: int, **gauges: Callable[[], float]) -> ServiceMetrics:
    """The metrics of ``service``: the one that answers ``generate`` also records generations."""
    cls = InferenceMetrics if MESSAGES["generate"].service == service else ServiceMetrics
    return cls(service, pid, **gauges)


def _sum(counter: Counter) -> int:
    return int(sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total")))
