"""CPU temperature and frequency from sysfs, and whether the board is throttling.

Edge boards (Raspberry Pi, RK3588, Jetson) slow their cores when hot: the
frequency drops below its maximum, often long before anything fails. Reading
``thermal_zone*/temp`` (millidegrees) and ``cpu*/cpufreq/scaling_cur_freq`` vs
``cpuinfo_max_freq`` (kHz) tells the optimizer to ease off. Boards without
these files simply report nothing and never count as throttled. The root is
configurable, so tests build a fake tree in a temporary directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ThermalReading:
    max_temp_c: float | None  # hottest thermal zone, None when the board exposes none
    freq_ratio: float | None  # slowest core's current / maximum frequency, None without cpufreq
    throttled: bool
    reason: str  # why it counts as throttled ("" when it does not)

    def as_dict(self) -> dict:
        return {"max_temp_c": self.max_temp_c, "freq_ratio": self.freq_ratio,
                "throttled": self.throttled, "reason": self.reason}


def _read_number(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def read_temperatures(root: Path) -> list[float]:
    """Celsius of every readable thermal zone under ``root`` (sysfs gives millidegrees)."""
    values = (_read_number(p) for p in sorted(root.glob("class/thermal/thermal_zone*/temp")))
    return [v / 1000.0 for v in values if v is not None]


def read_frequency_ratios(root: Path) -> list[float]:
    """Per core: current / maximum frequency, for cores that expose both."""
    ratios = []
    for freq_dir in sorted(root.glob("devices/system/cpu/cpu[0-9]*/cpufreq")):
        cur, top = _read_number(freq_dir / "scaling_cur_freq"), _read_number(freq_dir / "cpuinfo_max_freq")
        if cur is not None and top:
            ratios.append(cur / top)
    return ratios


def read_thermal(root: Path, freq_ratio_below: float, trip_c: float) -> ThermalReading:
    temps, ratios = read_temperatures(root), read_frequency_ratios(root)
    max_temp = max(temps) if temps else None
    ratio = min(ratios) if ratios else None
    reasons = []
    if ratio is not None and ratio < freq_ratio_below:
        reasons.append(f"frequency at {ratio:.0%} of max (< {freq_ratio_below:.0%})")
    if max_temp is not None and max_temp > trip_c:
        reasons.append(f"{max_temp:.1f} C over trip point {trip_c:g} C")
    return ThermalReading(max_temp, None if ratio is None else round(ratio, 3), bool(reasons), "; ".join(reasons))
