"""The tuning loop: telemetry samples in, ``engine.configure`` out, the strategy kept on disk.

The optimizer's handlers only queue samples and read or replace state under one lock; a thread of its own
(``run``) does the slow parts: it feeds the queued samples to the policy (``policy.py``) and the signals, sends
``engine.configure`` to inference whenever the wanted settings differ from what it runs (after a policy
decision, a thermal relief step, a restored strategy, or an inference restart noticed by a new pid), reads the
board's temperature and clock, and persists the strategy on every change and periodically.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from shared.client import Client, ServiceError
from shared.config import Config
from shared.protocol import ErrorCode
from services.optimizer import strategy as strategy_file
from services.optimizer.policy import Decision, Policy, Profile
from services.optimizer.relief import ThermalRelief
from services.optimizer.signals import ClassFigures, LatencyAlarm, SessionSpeeds
from services.optimizer.thermal import read_thermal

_RETRY_APPLY_S = 3.0  # after a failed engine.configure (inference down or starting)
_HEALTH_PROBE_S = 15.0  # how often inference's process (pid, instance) is checked when no telemetry arrives
_SAMPLE_QUEUE = 20000
_INGEST_BATCH = 2000

#: Who sent a sample: the process's pid and its instance id (``shared.process.INSTANCE``; None from an older sender).
Origin = tuple[int | None, str | None]


class Tuner:
    """The optimizer's state (policy, signals, thermal relief, what inference runs) and the loop that acts on it."""

    def __init__(self, config: Config, strategy_path: Path, log: Any):
        self.config, self.strategy_path, self.log = config, strategy_path, log
        opt = config.optimizer
        self._lock = threading.Lock()  # guards policy, signals, relief and the applied state
        self.policy = Policy(opt, config.engine.optimization_window, os.cpu_count() or 1,
                             has_draft_model=config.engine.draft_model_path is not None)
        self.relief = ThermalRelief(opt.thermal, n_threads_overridden="n_threads" in self.policy.overrides)
        self.alarm = LatencyAlarm(opt.p99_alert_s, config.engine.optimization_window, opt.alert_interval_s)
        self.speeds = SessionSpeeds(opt.compress_below)
        window = config.engine.optimization_window
        self.classes = ClassFigures(window)
        #: per priority class, an alarm on its generations' total seconds (queue wait included)
        self.class_alarms = {priority: LatencyAlarm(threshold, window, opt.alert_interval_s)
                             for priority, threshold in opt.priority_p99_alert_s.items()}
        self._samples: queue.Queue[tuple[str, Origin, dict]] = queue.Queue(maxsize=_SAMPLE_QUEUE)
        self._applied: dict[str, Any] | None = None  # what inference last confirmed running
        self.applied_id: str | None = None
        self._inference: Origin | None = None  # the inference process the strategy was pushed to
        self._dirty = False
        self._thermal: dict[str, Any] | None = None
        self._processes: dict[str, dict] = {}  # service -> its latest process figures (pid, RSS, CPU%, queue)
        restored = strategy_file.load(self.strategy_path, self.log)
        if restored is not None:
            self._restore(restored)
            self.log.info("strategy_restored", path=str(self.strategy_path), settings=restored.settings.given(),
                          settled=restored.settled)

    # --- what the handlers call (the service's worker thread) -------------------------------------
    def outcome(self, success: bool) -> str | None:
        """An agent run's outcome, counted against the settings that ran it (their settings_id)."""
        with self._lock:
            self.policy.outcome(success)
            return self.applied_id

    def offer(self, service: str, origin: Origin, sample: dict) -> bool:
        """Queue a checked sample from ``origin`` (the process's pid and instance) for the loop; False when the
        queue is full."""
        try:
            self._samples.put_nowait((service, origin, sample))
            return True
        except queue.Full:
            return False

    def strategy(self) -> dict:
        with self._lock:
            return {"strategy": self._strategy().model_dump(mode="json"), "path": str(self.strategy_path)}

    def replace_strategy(self, new: strategy_file.Strategy) -> dict:
        with self._lock:
            self._restore(new)
            self._persist()
            self.log.info("strategy_set", settings=new.settings.given(), settled=new.settled)
        return self.strategy()

    def status(self) -> dict:
        with self._lock:
            return {**self.policy.status(), "applied": self._applied, "settings_id": self.applied_id,
                    "inference_pid": self._inference[0] if self._inference else None, "thermal": self._thermal,
                    "relief_level": self.relief.level, "processes": dict(self._processes),
                    "by_priority": self.classes.figures()}

    def advice(self, session_id: str) -> dict:
        with self._lock:
            return self.speeds.advice(session_id)

    def save(self) -> None:
        with self._lock:
            self._persist()

    # --- strategy state (callers hold the lock) -----------------------------------------------
    def _strategy(self) -> strategy_file.Strategy:
        ref = self.policy.reference
        return strategy_file.Strategy(
            settings=self.policy.incumbent, settings_id=self.applied_id if self.policy.trial is None else None,
            settled=self.policy.phase == "settled",
            profile=None if ref is None else strategy_file.ProfileRecord(**ref.__dict__),
            decisions=[strategy_file.DecisionRecord(**d.__dict__) for d in self.policy.decisions],
            saved_at=time.time())

    def _restore(self, saved: strategy_file.Strategy) -> None:
        ref = None if saved.profile is None else Profile(**saved.profile.model_dump())
        self.policy.restore(saved.settings.given(), ref, saved.settled,
                            [Decision(**d.model_dump()) for d in saved.decisions])
        self._applied = None  # push it to inference
        self._dirty = True

    def _persist(self) -> None:
        try:
            strategy_file.save(self.strategy_path, self._strategy())
            self._dirty = False
        except (OSError, ValueError) as exc:  # ValueError: a setting the strategy format cannot hold
            self.log.error("strategy_save_failed", path=str(self.strategy_path), error=str(exc))

    # --- the loop (its own thread) -------------------------------------------------------------------
    def run(self, stopping: threading.Event) -> None:
        """The loop, until ``stopping`` is set."""
        inference = Client.for_service("inference", self.config, timeout_s=120.0)
        due = {"apply": 0.0, "thermal": 0.0, "probe": 0.0, "last_persist": time.monotonic()}
        while not stopping.is_set():
            try:
                self._control_step(inference, due)
            except Exception:  # a bug here must not end tuning for the life of the process
                self.log.error("controller_failed", exc_info=True)
                stopping.wait(1.0)
        inference.close()

    def _control_step(self, inference: Client, due: dict[str, float]) -> None:
        """One turn: ingest samples, read the board, notice an inference restart, apply, persist."""
        self.ingest(timeout_s=0.5)
        now = time.monotonic()
        if now >= due["thermal"] and self.config.optimizer.thermal.enabled:
            self._check_thermal()
            due["thermal"] = now + self.config.optimizer.thermal.check_interval_s
        if now >= due["probe"]:
            self._probe_inference(inference)
            due["probe"] = now + _HEALTH_PROBE_S
        with self._lock:
            wanted = self.relief.adjust(self.policy.target())
            needs_apply = self._applied is None or any(self._applied.get(k) != v for k, v in wanted.items())
        if needs_apply and now >= due["apply"] and not self._apply(inference, wanted):
            due["apply"] = now + _RETRY_APPLY_S
        with self._lock:
            if self._dirty or now - due["last_persist"] > self.config.optimizer.persist_interval_s:
                self._persist()
                due["last_persist"] = now

    def ingest(self, timeout_s: float) -> None:
        """Feed queued samples to the policy and the signals."""
        try:
            batch = [self._samples.get(timeout=timeout_s)]
        except queue.Empty:
            return
        while len(batch) < _INGEST_BATCH:
            try:
                batch.append(self._samples.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            for service, origin, sample in batch:
                self._take_sample(service, origin, sample)

    def _take_sample(self, service: str, origin: Origin, sample: dict) -> None:
        """``origin``: the sending process's (pid, instance); a new one of inference is a restarted process, also
        where the pid repeats (a replaced container's inference has its predecessor's pid)."""
        pid = origin[0]
        if service == "inference" and pid is not None and origin != self._inference:
            if self._inference is not None:
                self.log.info("inference_restarted", old_pid=self._inference[0], pid=pid)
                self._applied = None  # a fresh process runs its config defaults: push the strategy again
            self._inference = origin
        kind = sample.get("type")
        if kind == "_system":
            self._processes[service] = {"pid": pid, **{k: v for k, v in sample.items() if k != "type"}}
        elif "latency_s" in sample:  # the generic sample every service runtime reports
            alert = self.alarm.add(service, float(sample["latency_s"]))
            if alert:
                self.log.warning("latency_alert", **alert)
            strategy_failure = sample.get("code") == ErrorCode.INTERNAL  # not the client's bad_request or busy
            if service == "inference" and kind == "generate" and self.relief.level == 0 and (
                    sample.get("ok") or strategy_failure):
                self.policy.outcome(bool(sample.get("ok")))
        elif kind == "generation":  # the inference result of one finished generate
            self.speeds.add(sample.get("session"), int(sample.get("completion_tokens") or 0), sample.get("decode_tps"))
            self._take_class_figures(sample)
            if self.relief.level == 0 and self._applied is not None and self.config.engine.self_optimize:
                before = self.policy.phase, self.policy.trial
                if self.policy.add(sample):
                    self._dirty = True
                if (self.policy.phase, self.policy.trial) != before:
                    self.log.info("optimizer_decision", phase=self.policy.phase, trial=self.policy.trial,
                                  last=self.policy.decisions[-1].__dict__ if self.policy.decisions else None)

    def _take_class_figures(self, sample: dict) -> None:
        """A generation's figures in its priority class, and that class's p99 alarm."""
        priority, total_s = sample.get("priority"), sample.get("total_s")
        if priority is None or total_s is None:
            return
        self.classes.add(priority, float(sample.get("ttft_s", total_s)), float(total_s), sample.get("decode_tps"))
        alarm = self.class_alarms.get(priority)
        alert = alarm.add("inference", float(total_s)) if alarm else None
        if alert:
            self.log.warning("latency_alert", priority=priority, **alert)

    def _check_thermal(self) -> None:
        cfg = self.config.optimizer.thermal
        reading = read_thermal(cfg.sysfs_root, cfg.freq_ratio_below, cfg.trip_c)
        with self._lock:
            self._thermal = reading.as_dict()
            change = self.relief.observe(reading)
            if change > 0:
                self.log.warning("thermal_throttle", level=self.relief.level, **reading.as_dict())
            elif change < 0:
                self.log.info("thermal_relief_eased", level=self.relief.level, **reading.as_dict())
                if self.relief.level == 0:
                    self.policy.restart_window()  # samples under relief do not count

    def _probe_inference(self, inference: Client) -> None:
        try:
            health = inference.health()
        except ServiceError:
            return
        with self._lock:
            self._take_sample("inference", (health.get("pid"), health.get("instance")), {"type": "_probe"})

    def _apply(self, inference: Client, wanted: dict[str, Any]) -> bool:
        """Send ``wanted`` to inference; True once it confirmed."""
        try:
            reply = inference.request("engine.configure", {"settings": wanted})
        except ServiceError as err:
            self.log.info("configure_failed", code=err.code, error=err.message[:200], settings=wanted)
            if err.code == ErrorCode.BAD_REQUEST:
                with self._lock:
                    self.policy.refused(err.message[:200])
                    self._dirty = True
            return False
        with self._lock:
            self._applied = reply.get("settings") or dict(wanted)
            self.applied_id = reply.get("settings_id")
            self.policy.applied(self._applied, self.applied_id, bool(reply.get("reloaded")))
            self._dirty = True
        self.log.info("engine_configured", settings=self._applied, settings_id=self.applied_id,
                      reloaded=bool(reply.get("reloaded")))
        self._probe_inference(inference)  # learn the pid this configuration went to
        return True
