"""Thermal awareness on a fake sysfs tree: readings, throttling, and the optimizer's relief steps."""

from __future__ import annotations

from pathlib import Path

from shared.config import ThermalConfig
from services.optimizer.thermal import read_thermal
from services.optimizer.relief import ThermalRelief

MAX_KHZ = 2_000_000


class FakeBoard:
    """A sysfs tree of a 4-core board whose clock halves (and which runs hot) after five minutes."""

    def __init__(self, root: Path, cores: int = 4):
        self.root = root
        for i in range(cores):
            freq = root / f"devices/system/cpu/cpu{i}/cpufreq"
            freq.mkdir(parents=True)
            (freq / "cpuinfo_max_freq").write_text(f"{MAX_KHZ}\n")
        (root / "devices/system/cpu/cpufreq").mkdir(parents=True)  # not a core: ignored
        (root / "class/thermal/thermal_zone0").mkdir(parents=True)
        self.cores = cores

    def at(self, t_s: float) -> None:
        """Write what the board shows ``t_s`` seconds after boot."""
        hot = t_s >= 300
        for i in range(self.cores):
            khz = MAX_KHZ // 2 if hot else MAX_KHZ
            (self.root / f"devices/system/cpu/cpu{i}/cpufreq/scaling_cur_freq").write_text(f"{khz}\n")
        (self.root / "class/thermal/thermal_zone0/temp").write_text("80000\n" if hot else "55000\n")


def test_a_board_without_sensors_is_never_throttled(tmp_path):
    reading = read_thermal(tmp_path, freq_ratio_below=0.75, trip_c=85)
    assert reading.max_temp_c is None and reading.freq_ratio is None and not reading.throttled


def test_readings_from_the_fake_tree(tmp_path):
    board = FakeBoard(tmp_path)
    board.at(0)
    cool = read_thermal(tmp_path, freq_ratio_below=0.75, trip_c=85)
    assert cool.max_temp_c == 55.0 and cool.freq_ratio == 1.0 and not cool.throttled
    (tmp_path / "class/thermal/thermal_zone0/temp").write_text("91500\n")
    hot = read_thermal(tmp_path, freq_ratio_below=0.75, trip_c=85)
    assert hot.throttled and "trip point" in hot.reason


def test_board_whose_speed_halves_after_five_minutes(tmp_path):
    board = FakeBoard(tmp_path)
    config = ThermalConfig(sysfs_root=tmp_path, check_interval_s=30, cool_checks=2, max_steps=2, pause_step_ms=20)
    relief = ThermalRelief(config)
    tuned = {"n_threads": 4, "decode_pause_ms": 0, "spec_draft_tokens": 4}
    applied = []
    for t in range(0, 600, 30):  # one reading every 30 s of board time, no sleeping
        board.at(t)
        reading = read_thermal(tmp_path, config.freq_ratio_below, config.trip_c)
        relief.observe(reading)
        applied.append((t, reading.throttled, relief.adjust(tuned)))
    before = [a for t, _, a in applied if t < 300]
    assert all(a == tuned for a in before)  # full speed: nothing changes
    throttled = [(t, a) for t, thr, a in applied if thr]
    assert throttled[0][0] == 300 and all(t >= 300 for t, _ in throttled)
    assert throttled[0][1] == {"n_threads": 3, "decode_pause_ms": 20, "spec_draft_tokens": 4}
    assert applied[-1][2] == {"n_threads": 2, "decode_pause_ms": 40, "spec_draft_tokens": 4}  # capped at max_steps
    for t in range(600, 600 + 30 * 4, 30):  # the board cools: relief is undone step by step
        board.at(0)
        relief.observe(read_thermal(tmp_path, config.freq_ratio_below, config.trip_c))
    assert relief.level == 0 and relief.adjust(tuned) == tuned


def test_relief_keeps_an_overridden_thread_count(tmp_path):
    relief = ThermalRelief(ThermalConfig(sysfs_root=tmp_path), n_threads_overridden=True)
    board = FakeBoard(tmp_path)
    board.at(301)
    relief.observe(read_thermal(tmp_path, 0.75, 85))
    assert relief.adjust({"n_threads": 2, "decode_pause_ms": 0}) == {"n_threads": 2, "decode_pause_ms": 20}
