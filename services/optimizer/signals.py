"""Signals the optimizer derives from telemetry besides tuning: p99 alerts, per-class speed figures and
context-compression advice."""

from __future__ import annotations

import statistics
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


class ClassFigures:
    """Per priority class, the latest ``window`` generations' speeds: what each class gets of the box (the
    scheduler slows background work on purpose while interactive work runs, so one figure for all hides it)."""

    def __init__(self, window: int):
        self.window = window
        self._samples: dict[str, deque[tuple[float, float, float | None]]] = {}

    def add(self, priority: str, ttft_s: float, total_s: float, decode_tps: float | None) -> None:
        self._samples.setdefault(priority, deque(maxlen=self.window)).append((ttft_s, total_s, decode_tps))

    def figures(self) -> dict[str, dict[str, float | int | None]]:
        """Per class: how many generations, median TTFT and decode speed, p99 of their total seconds."""
        out: dict[str, dict[str, float | int | None]] = {}
        for priority, samples in sorted(self._samples.items()):
            speeds = [tps for _, _, tps in samples if tps]
            out[priority] = {"generations": len(samples),
                             "ttft_s_p50": round(statistics.median(t for t, _, _ in samples), 4),
                             "decode_tps_p50": round(statistics.median(speeds), 2) if speeds else None,
                             "total_s_p99": round(p99([total for _, total, _ in samples]), 4)}
        return out


class SessionSpeeds:
    """Each session's first and latest decode speed, to advise compressing a context that has grown slow."""

    MIN_TOKENS = 8  # shorter generations give too noisy a speed
    MAX_SESSIONS = 4096

    def __init__(self, compress_below: float):
        self.compress_below = compress_below
        self._speeds: OrderedDict[str, tuple[float, float]] = OrderedDict()  # session -> (first, latest)

    def add(self, session_id: str | None, completion_tokens: int, decode_tps: float | None) -> None:
        if not session_id or not decode_tps or completion_tokens < self.MIN_TOKENS:
            return
        first = self._speeds.pop(session_id, (decode_tps, decode_tps))[0]
        self._speeds[session_id] = (first, decode_tps)
        while len(self._speeds) > self.MAX_SESSIONS:
            self._speeds.popitem(last=False)

    def advice(self, session_id: str) -> dict:
        if session_id not in self._speeds:
            return {"compress": False, "start_tps": None, "last_tps": None, "ratio": None}
        first, last = self._speeds[session_id]
        ratio = last / first
        return {"compress": ratio < self.compress_below, "start_tps": round(first, 2), "last_tps": round(last, 2),
                "ratio": round(ratio, 3)}
