"""Inference gets the box's best CPU time: a higher priority (nice) and, on big.LITTLE boards, the big cores.

Big cores are the CPUs with the highest ``cpufreq/cpuinfo_max_freq`` under the
sysfs root. Where every core has the same maximum, or sysfs does not say,
nothing is pinned (pinning would only take cores away). Linux keeps nice and
affinity per thread, so the local backend applies both to every thread of the
process; threads created later inherit them from their creator.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import psutil


def big_cores(sysfs_root: Path, allowed: Iterable[int] | None = None) -> tuple[set[int] | None, str]:
    """The CPUs to pin inference to (None: do not pin) and why, in words for the log."""
    cpu_dir = Path(sysfs_root) / "devices" / "system" / "cpu"
    freqs: dict[int, int] = {}
    for entry in cpu_dir.glob("cpu[0-9]*"):
        try:
            freqs[int(entry.name[3:])] = int((entry / "cpufreq" / "cpuinfo_max_freq").read_text().strip())
        except (OSError, ValueError):
            continue  # offline core or no cpufreq driver for it
    if allowed is not None:
        freqs = {cpu: f for cpu, f in freqs.items() if cpu in set(allowed)}
    if not freqs:
        return None, f"no cpu*/cpufreq/cpuinfo_max_freq under {cpu_dir} for the CPUs this process may use"
    top = max(freqs.values())
    if len(set(freqs.values())) == 1:
        return None, f"all {len(freqs)} cores have the same max frequency ({top} kHz)"
    fastest = {cpu for cpu, f in freqs.items() if f == top}
    return fastest, f"{len(fastest)} of {len(freqs)} cores run up to {top} kHz"


def allowed_cpus() -> set[int] | None:
    """The CPUs this process may run on (a container's cpuset, taskset); None where the OS does not say."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _thread_ids(pid: int) -> list[int]:
    try:
        return [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return []


def renice_process(pid: int, nice: int) -> None:
    """Set ``nice`` on every thread of ``pid``; PermissionError when raising priority is not allowed."""
    for tid in _thread_ids(pid):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # the thread ended meanwhile


def pin_process(pid: int, cpus: set[int]) -> None:
    """Restrict every thread of ``pid`` to ``cpus``."""
    for tid in _thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:
            continue
