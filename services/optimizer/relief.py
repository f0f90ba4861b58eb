"""Thermal relief: ease the engine off while the board throttles, and undo it step by step once it cools.

Each relief step takes one llama.cpp thread away (unless ``n_threads`` is a
manual override) and adds ``pause_step_ms`` between decode steps. A throttled
reading adds a step (up to ``max_steps``); ``cool_checks`` normal readings in
a row take one back. Pure logic: the optimizer feeds readings and applies
``adjust(settings)``.
"""

from __future__ import annotations

from typing import Any

from shared.config import ThermalConfig
from services.optimizer.thermal import ThermalReading


class ThermalRelief:
    def __init__(self, config: ThermalConfig, n_threads_overridden: bool = False):
        self.config = config
        self.n_threads_overridden = n_threads_overridden
        self.level = 0
        self._cool_streak = 0

    def observe(self, reading: ThermalReading) -> int:
        """Update the relief level from one reading; returns the change (+1, -1 or 0)."""
        if reading.throttled:
            self._cool_streak = 0
            if self.level < self.config.max_steps:
                self.level += 1
                return 1
            return 0
        if self.level == 0:
            return 0
        self._cool_streak += 1
        if self._cool_streak >= self.config.cool_checks:
            self._cool_streak = 0
            self.level -= 1
            return -1
        return 0

    def adjust(self, settings: dict[str, Any]) -> dict[str, Any]:
        """``settings`` with the current relief applied (unchanged at level 0)."""
        if self.level == 0:
            return settings
        adjusted = dict(settings)
        if not self.n_threads_overridden and settings.get("n_threads"):
            adjusted["n_threads"] = max(1, settings["n_threads"] - self.level)
        adjusted["decode_pause_ms"] = min(1000, settings.get("decode_pause_ms", 0) + self.level * self.config.pause_step_ms)
        return adjusted
