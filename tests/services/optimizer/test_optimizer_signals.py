"""p99 latency alerts, context-compression advice and the strategy file, as units."""

from __future__ import annotations

import json

import pytest

from services.optimizer import strategy as strategy_file
from services.optimizer.signals import LatencyAlarm, SessionSpeeds, p99


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_p99_nearest_rank():
    assert p99([1.0] * 99 + [5.0]) == 1.0
    assert p99([1.0] * 98 + [5.0, 6.0]) == 5.0
    assert p99([3.0]) == 3.0


def test_latency_alert_fires_on_a_full_window_and_is_rate_limited():
    clock = Clock()
    alarm = LatencyAlarm(threshold_s=2.0, window=10, interval_s=60, clock=clock)
    assert all(alarm.add("inference", 0.5) is None for _ in range(10))
    alert = None
    for _ in range(10):
        alert = alert or alarm.add("inference", 3.0)
    assert alert == {"service": "inference", "p99": 3.0, "threshold": 2.0, "window": 10}
    assert alarm.add("inference", 3.0) is None  # rate-limited
    assert alarm.add("tools", 3.0) is None  # other services have their own window
    clock.now = 61
    assert alarm.add("inference", 3.0)["p99"] == 3.0
    assert LatencyAlarm(None, 1, 0).add("inference", 100.0) is None  # alerts off


def test_compression_advice_once_decode_speed_halves():
    speeds = SessionSpeeds(compress_below=0.5)
    assert speeds.advice("s1")["compress"] is False  # unknown session
    speeds.add("s1", 50, 40.0)
    speeds.add("s1", 3, 5.0)  # too short to count
    speeds.add("s1", 50, 30.0)
    assert speeds.advice("s1") == {"compress": False, "start_tps": 40.0, "last_tps": 30.0, "ratio": 0.75}
    speeds.add("s1", 50, 19.0)
    assert speeds.advice("s1")["compress"] is True


class Log:
    def __init__(self):
        self.events = []

    def error(self, event, **fields):
        self.events.append((event, fields))


def test_strategy_file_roundtrip_is_atomic(tmp_path):
    path = tmp_path / "strategy.json"
    saved = strategy_file.Strategy(settings={"n_threads": 2, "spec_draft_tokens": 4}, settled=True, saved_at=1.0)
    strategy_file.save(path, saved)
    assert [p.name for p in tmp_path.iterdir()] == ["strategy.json"]  # no temporary file left behind
    assert strategy_file.load(path, Log()) == saved


@pytest.mark.parametrize("content, reason", [
    ("{not json", "Expecting property name"),
    (json.dumps({"format": "magnitude-strategy", "version": 99}), "version 99 is not supported"),
    (json.dumps({"format": "something-else", "version": 1}), "format is 'something-else'"),
    (json.dumps({"format": "magnitude-strategy", "version": 1, "settings": {"n_threads": -3}}), "settings.n_threads"),
])
def test_a_bad_strategy_file_is_rejected_and_set_aside(tmp_path, content, reason):
    path = tmp_path / "strategy.json"
    path.write_text(content)
    log = Log()
    assert strategy_file.load(path, log) is None
    (event, fields), = log.events
    assert event == "strategy_rejected" and fields["path"] == str(path) and reason in fields["reason"]
    assert not path.exists()
    aside = list(tmp_path.glob("strategy.json.rejected-*"))
    assert len(aside) == 1 and aside[0].read_text() == content  # kept for a human, not lost
