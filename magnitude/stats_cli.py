"""``magnitude stats``: one row per service, read from its Prometheus metrics over ZeroMQ.

Each service answers the ``metrics`` message with its text exposition (the same
text its HTTP ``/metrics`` endpoint serves); this module parses it with
prometheus_client's parser and reduces it to a row. Percentiles come from the
histogram buckets the way Prometheus' ``histogram_quantile`` computes them
(linear within a bucket), so they are estimates at bucket resolution.
``health`` and ``metrics`` requests (probes like this one) are left out of the
request count and the latency percentiles.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config

#: Monitoring requests, not work: excluded from the row's requests and latency.
PROBES = frozenset({"health", "metrics"})

_COLUMNS = (("service", "SERVICE", 11), ("status", "STATUS", 6), ("requests", "REQUESTS", 8),
            ("p50_ms", "P50 MS", 8), ("p95_ms", "P95 MS", 8), ("ttft_p50_ms", "TTFT P50 MS", 11),
            ("decode_tps_p50", "DECODE TOK/S", 12), ("cache_hit_ratio", "CACHE HIT", 9),
            ("queue_depth", "QUEUE", 5), ("rss_mb", "RSS MB", 7), ("restarts", "RESTARTS", 8),
            ("errors", "ERRORS", 0))


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """The q-quantile of a histogram given as {upper bound: cumulative count}; None if it is empty.

    As Prometheus does it: find the bucket holding rank q*count and interpolate linearly inside it;
    a rank in the +Inf bucket returns the highest finite bound.
    """
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return lower


def _samples(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Sample name -> [(labels, value)] of one exposition."""
    out: dict[str, list[tuple[dict, float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def _buckets(samples: dict, histogram: str, skip_types: frozenset = frozenset()) -> dict[float, float]:
    """A histogram's cumulative bucket counts, summed over its labels (except ``type``s in ``skip_types``)."""
    summed: dict[float, float] = defaultdict(float)
    for labels, value in samples.get(histogram + "_bucket", []):
        if labels.get("type") not in skip_types:
            summed[float(labels["le"])] += value
    return summed


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def summarize(service: str, text: str) -> dict:
    """One row of ``magnitude stats`` from a service's exposition text."""
    s = _samples(text)
    latency = _buckets(s, "magnitude_request_seconds", PROBES)
    cache = {labels["result"]: value for labels, value in s.get("magnitude_prefix_cache_requests_total", [])}
    looked_up = cache.get("hit", 0) + cache.get("miss", 0)
    decode_tps = histogram_quantile(0.5, _buckets(s, "magnitude_decode_tokens_per_second"))
    rss = s.get("process_resident_memory_bytes")
    return {
        "service": service,
        "status": "up",
        "requests": int(sum(v for labels, v in s.get("magnitude_requests_total", []) if labels["type"] not in PROBES)),
        "errors": {labels["code"]: int(v) for labels, v in s.get("magnitude_errors_total", []) if v},
        "p50_ms": _ms(histogram_quantile(0.5, latency)),
        "p95_ms": _ms(histogram_quantile(0.95, latency)),
        "ttft_p50_ms": _ms(histogram_quantile(0.5, _buckets(s, "magnitude_ttft_seconds"))),
        "decode_tps_p50": None if decode_tps is None else round(decode_tps, 1),
        "cache_hit_ratio": round(cache.get("hit", 0) / looked_up, 3) if looked_up else None,
        "queue_depth": int(s["magnitude_queue_depth"][0][1]) if "magnitude_queue_depth" in s else None,
        "rss_mb": round(rss[0][1] / 2**20, 1) if rss else None,
    }


def _exposition(config: Config, name: str, timeout_s: float) -> str:
    with Client.for_service(name, config, timeout_s=timeout_s) as client:
        return client.request("metrics")["text"]


def restarts_by_service(text: str) -> dict[str, int]:
    """The watchdog's restarts per supervised service (all reasons), from its exposition."""
    counts: dict[str, int] = defaultdict(int)
    for labels, value in _samples(text).get("magnitude_restarts_total", []):
        counts[labels["service"]] += int(value)
    return counts


def collect(config: Config, names: list[str], timeout_s: float) -> list[dict]:
    """A row per service; one that does not answer is ``down`` with the reason. Restarts come from the
    watchdog's metrics (None when no watchdog answers)."""
    try:
        restarts = restarts_by_service(_exposition(config, WATCHDOG_NAME, timeout_s))
    except ServiceError:
        restarts = None
    rows = []
    for name in names:
        try:
            row = summarize(name, _exposition(config, name, timeout_s))
            row["restarts"] = None if restarts is None else restarts.get(name, 0)
            rows.append(row)
        except ServiceError as err:
            rows.append({"service": name, "status": "down", "error": f"{err.code}: {err.message}"})
    return rows


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key == "errors":
        return " ".join(f"{code}={n}" for code, n in sorted(value.items())) or "0"
    if key == "cache_hit_ratio":
        return f"{value:.0%}"
    return str(value)


def format_table(rows: list[dict]) -> str:
    lines = [" ".join(title.ljust(width) for _, title, width in _COLUMNS).rstrip()]
    for row in rows:
        if row["status"] == "down":
            lines.append(f"{row['service']:<11} {'down':<6} {row['error']}")
            continue
        lines.append(" ".join(_cell(key, row.get(key)).ljust(width) for key, _, width in _COLUMNS).rstrip())
    return "\n".join(lines)


def cmd_stats(args, config) -> int:
    rows = collect(config, args.service or list(SERVICE_NAMES), args.timeout)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0 if all(row["status"] == "up" for row in rows) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="requests, errors, latency, TTFT, tok/s, cache hits, queue, RSS per service; "
                                     "exit 1 if any is down",
                       description="One row per service from its Prometheus metrics (the `metrics` message). "
                                   "Latency percentiles leave out health/metrics probes; percentiles are "
                                   "estimated from histogram buckets.")
    p.add_argument("--service", action="append", choices=SERVICE_NAMES, help="only this service (repeatable)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait per service (default 5)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_stats)
