"""Signals the optimizer derives from telemetry besides tuning: p99 alerts and context-compression advice."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from typing import Callable


def p99(values: list[float]) -> float:
    """Nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, -(-99 * len(ordered) // 100) - 1))]


class LatencyAlarm:
    """Per service, a sliding window of request latencies; fires when its p99 crosses the threshold.

    ``add`` returns the alert fields (``service``, ``p99``, ``threshold``, ``window``) or None;
    at most one alert per service every ``interval_s`` (rate limit), and only on a full window.
    """

    def __init__(self, threshold_s: float | None, window: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold_s, self.window, self.interval_s, self.clock = threshold_s, window, interval_s, clock
        self._latencies: dict[str, deque[float]] = {}
        self._last_alert: dict[str, float] = {}

    def add(self, service: str, latency_s: float) -> dict | None:
        if self.threshold_s is None:
            return None
        window = self._latencies.setdefault(service, deque(maxlen=self.window))
        window.append(latency_s)
        if len(window) < self.window:
            return None
        value = p99(list(window))
        last = self._last_alert.get(service)
        if value <= self.threshold_s or (last is not None and self.clock() - last < self.interval_s):
            return None
        self._last_alert[service] = self.clock()
        return {"service": service, "p99": round(value, 4), "threshold": self.threshold_s, "window": self.window}


class SessionSpeeds:
    """Each session's first and latest decode speed, to advise compressing a context that has grown slow."""

    MIN_TOKENS = 8  # shorter generations give too noisy a speed
    MAX_SESSIONS = 4096

    def __init__(self, compress_below: float):
        self.compress_below = compress_below
        self._speeds: OrderedDict[str, tuple[float, float]] = OrderedDict()  # session -> (first, latest)

    def add(self, session: str | None, completion_tokens: int, decode_tps: float | None) -> None:
        if not session or not decode_tps or completion_tokens < self.MIN_TOKENS:
            return
        first = self._speeds.pop(session, (decode_tps, decode_tps))[0]
        self._speeds[session] = (first, decode_tps)
        while len(self._speeds) > self.MAX_SESSIONS:
            self._speeds.popitem(last=False)

    def advice(self, session: str) -> dict:
        if session not in self._speeds:
            return {"compress": False, "start_tps": None, "last_tps": None, "ratio": None}
        first, last = self._speeds[session]
        ratio = last / first
        return {"compress": ratio < self.compress_below, "start_tps": round(first, 2), "last_tps": round(last, 2),
                "ratio": round(ratio, 3)}
