"""The operations sections: the self-optimizer (with thermal relief) and the watchdog."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from shared.config.base import Section, require_known_services
from shared.config.engine import TunableSettings
from shared.protocol import PRIORITIES

class ThermalConfig(Section):
    """When the board counts as throttling, and how the optimizer eases off (see services/optimizer/thermal.py)."""

    enabled: bool = True
    sysfs_root: Path = Field(Path("/sys"), description="where thermal_zone*/ and cpu*/cpufreq/ are read; "
                                                         "a fake tree in tests")
    freq_ratio_below: float = Field(0.75, gt=0, le=1, description="throttled when cur/max CPU frequency is below this")
    trip_c: float = Field(85.0, gt=0, le=150, description="throttled when any thermal zone is above this (Celsius)")
    check_interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between sysfs readings")
    cool_checks: int = Field(3, ge=1, le=1000, description="normal readings in a row before one relief step is undone")
    pause_step_ms: int = Field(20, ge=1, le=1000, description="decode_pause_ms added per relief step")
    max_steps: int = Field(4, ge=1, le=50, description="most relief steps (each: one thread fewer, one pause step more)")


class OptimizerConfig(Section):
    """The self-optimizer (services/optimizer); the window size is engine.optimization_window."""

    min_gain: float = Field(0.05, ge=0, lt=1, description="a trial is kept only if the window median improves "
                                                           "by at least this share (hysteresis)")
    warmup_samples: int = Field(2, ge=0, le=1000, description="samples discarded after a hot change")
    rebuild_warmup_samples: int = Field(4, ge=0, le=1000, description="samples discarded after a context rebuild")
    drift: float = Field(0.25, gt=0, le=10, description="a settled median this much worse re-starts exploration")
    max_passes: int = Field(3, ge=1, le=100, description="exploration passes over the candidates before settling")
    max_failure_increase: float = Field(0.1, ge=0, le=1, description="a trial whose failure rate exceeds the "
                                                                      "incumbent's by more than this is rejected")
    overrides: TunableSettings = Field(default_factory=TunableSettings,
                                       description="fixed knob values: applied, never tuned")
    compress_below: float = Field(0.5, gt=0, le=1, description="advise context compression once a session's decode "
                                                                "speed falls below this share of its start")
    p99_alert_s: float | None = Field(30.0, gt=0, description="log latency_alert when a window's p99 crosses this; "
                                                              "null = off")
    priority_p99_alert_s: dict[str, Annotated[float, Field(gt=0)]] = Field(
        {"interactive": 10.0}, description="per priority class, log latency_alert (with the priority) when the p99 of "
        "a window of its generations' total seconds, queue wait included, crosses this; a class not listed: none")
    alert_interval_s: float = Field(300.0, ge=0, description="at most one latency_alert per service (per class) "
                                                             "this often")
    strategy_path: Path | None = Field(None, description="learned strategy file; default DATA_DIR/strategy.json")
    persist_interval_s: float = Field(60.0, gt=0, description="the strategy is also saved this often")
    max_feedback_rows: int = Field(100_000, ge=100, le=100_000_000, description="feedback rows kept; older ones "
                                                                                 "are deleted as new ones come")
    thermal: ThermalConfig = Field(default_factory=ThermalConfig)

    @field_validator("priority_p99_alert_s")
    @classmethod
    def _known_priorities(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(PRIORITIES))
        if unknown:
            raise ValueError(f"unknown priority {', '.join(unknown)} (one of {', '.join(PRIORITIES)})")
        return v


#: What the watchdog may supervise: compose containers or a Swarm stack's tasks through the docker API, or local
#: processes.
BACKEND_KINDS = ("auto", "local", "docker", "swarm")
#: Set by whoever starts the watchdog (``magnitude up``: local, compose.yaml: docker, the Swarm stack: swarm); wins
#: over watchdog.backend.
WATCHDOG_BACKEND_ENV = "MAGNITUDE_WATCHDOG_BACKEND"


class WatchdogConfig(Section):
    """How the watchdog supervises the services: heartbeat, restarts, memory ceiling, inference priority."""

    enabled: bool = Field(True, description="`magnitude up` starts the watchdog after the services")
    backend: Literal["auto", "local", "docker", "swarm"] = Field(
        "auto", description="docker: restart compose containers through the docker socket; swarm: end this node's "
                            "task of a Swarm stack and let Swarm replace it; local: processes with pid files; auto: "
                            "docker only in a compose container. $MAGNITUDE_WATCHDOG_BACKEND wins: `magnitude up` "
                            "sets it to local, compose.yaml to docker, the Swarm stack to swarm")
    interval_s: float = Field(2.0, gt=0, le=3600, description="seconds between heartbeats of each service")
    health_timeout_s: float = Field(1.0, gt=0, le=60, description="a health request slower than this failed")
    hung_checks: int = Field(3, ge=1, le=1000, description="consecutive failed heartbeats of a live process: "
                                                           "hung, SIGKILL and restart")
    start_timeout_s: float = Field(120.0, gt=0, le=3600, description="a (re)started service must answer "
                                                                     "health within this, or it is hung")
    backoff_initial_s: float = Field(1.0, gt=0, le=3600, description="wait before a repeated restart; doubles")
    backoff_max_s: float = Field(60.0, gt=0, le=86400, description="longest wait between restarts")
    backoff_reset_s: float = Field(60.0, gt=0, le=86400, description="healthy this long: the backoff resets")
    memory_ceiling_mb: int | None = Field(None, ge=1, le=1 << 24, description="RSS above which a service is "
                                          "restarted gracefully; default (null): 75% of physical memory")
    service_memory_ceiling_mb: dict[str, Annotated[int, Field(ge=1, le=1 << 24)]] = Field(
        default_factory=dict, description="per-service ceilings over memory_ceiling_mb")
    inference_nice: int = Field(-5, ge=-20, le=19, description="nice value given to the inference process "
                                                              "(negative needs CAP_SYS_NICE; else a warning)")
    pin_inference: bool = Field(True, description="pin inference to the big cores (highest cpuinfo_max_freq)")
    sysfs_root: Path = Field(Path("/sys"), description="where to read cpu*/cpufreq/cpuinfo_max_freq")
    compose_project: str | None = Field(None, description="docker backend: compose project label (swarm: the "
                                                          "stack's name); default: the watchdog container's own")

    @field_validator("service_memory_ceiling_mb")
    @classmethod
    def _ceilings_name_services(cls, v: dict[str, int]) -> dict[str, int]:
        require_known_services(v)
        return v

    @field_validator("backoff_max_s")
    @classmethod
    def _max_covers_initial(cls, v: float, info: Any) -> float:
        initial = info.data.get("backoff_initial_s")
        if initial is not None and v < initial:
            raise ValueError(f"must be >= backoff_initial_s ({initial})")
        return v


