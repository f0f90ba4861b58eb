"""The optimizer process: feedback store, telemetry intake, and the tuning loop that configures inference.

Handlers (``feedback``, ``telemetry``, ``strategy.*``, ``optimizer.*``) run on
the service worker and only touch in-memory state under one lock. A separate
controller thread does the slow parts: it feeds telemetry samples to the
policy (services/optimizer/policy.py), sends ``engine.configure`` to inference
whenever the wanted settings differ from what it runs (after a policy decision,
a thermal relief step, a restored strategy, or an inference restart noticed
by a new pid), reads the board's temperature and clock, and persists the
strategy on every change and periodically.

Feedback goes to SQLite through apsw with ``synchronous=FULL`` in WAL mode,
so an acknowledged row survives a power cut; each row carries the settings_id
the engine ran, so ``feedback.stats`` counts outcomes per strategy.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from typing import Any, Callable

import apsw

from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.security import private_dir
from shared.service import Emitter, Service
from shared.telemetry import NullTelemetry, Telemetry, validate_sample, validate_system
from services.optimizer.thermal import read_thermal
from services.optimizer import strategy as strategy_file
from services.optimizer.policy import Decision, Policy, Profile
from services.optimizer.relief import ThermalRelief
from services.optimizer.signals import LatencyAlarm, SessionSpeeds

_SCHEMA = """
CREATE TABLE IF NOT EXISTS feedback (
    id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    session_id TEXT NOT NULL,
    success INTEGER NOT NULL,
    error_reason TEXT,
    details TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS feedback_session ON feedback(session_id);
"""
_RETRY_APPLY_S = 3.0  # after a failed engine.configure (inference down or starting)
_HEALTH_PROBE_S = 15.0  # how often inference's pid is checked when no telemetry arrives
_SAMPLE_QUEUE = 20000
#: Processes whose telemetry is taken: every dict keyed by a sender's service name is bounded by this list.
_REPORTING = (*SERVICE_NAMES, WATCHDOG_NAME)
_REPORTED_ERRORS = 5  # rejected samples named in a reply


class OptimizerService(Service):
    name = "optimizer"

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        data_dir = config.runtime.resolved_data_dir()
        private_dir(data_dir)
        self.db_path = data_dir / "feedback.db"
        self.db = apsw.Connection(str(self.db_path))
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(_SCHEMA)
        self._migrate()
        self._lock = threading.Lock()  # guards policy, signals, relief and the applied state
        opt = config.optimizer
        self.strategy_path = opt.strategy_path or data_dir / "strategy.json"
        self.policy = Policy(opt, config.engine.optimization_window, os.cpu_count() or 1,
                             has_draft_model=config.engine.draft_model_path is not None)
        self.relief = ThermalRelief(opt.thermal, n_threads_overridden="n_threads" in self.policy.overrides)
        self.alarm = LatencyAlarm(opt.p99_alert_s, config.engine.optimization_window, opt.alert_interval_s)
        self.speeds = SessionSpeeds(opt.compress_below)
        self._samples: queue.Queue[tuple[str, int | None, dict]] = queue.Queue(maxsize=_SAMPLE_QUEUE)
        self._applied: dict[str, Any] | None = None  # what inference last confirmed running
        self._applied_id: str | None = None
        self._inference_pid: int | None = None
        self._dirty = False
        self._thermal: dict[str, Any] | None = None
        self._processes: dict[str, dict] = {}  # service -> its latest process figures (pid, RSS, CPU%, queue)
        restored = strategy_file.load(self.strategy_path, self.log)
        if restored is not None:
            self._restore(restored)
            self.log.info("strategy_restored", path=str(self.strategy_path), settings=restored.settings.given(),
                          settled=restored.settled)
        for msg_type, handler in (("feedback", self._feedback), ("feedback.stats", self._stats),
                                  ("telemetry", self._telemetry), ("strategy.get", self._strategy_get),
                                  ("strategy.set", self._strategy_set), ("optimizer.status", self._status),
                                  ("optimizer.advice", self._advice)):
            self.handle(msg_type, handler)
        self._controller = threading.Thread(target=self._control_loop, name="optimizer-controller", daemon=True)

    def make_telemetry(self) -> Telemetry:
        return NullTelemetry()  # the optimizer must not report to itself

    def health_details(self) -> dict[str, Any]:
        return {"db_path": str(self.db_path), "strategy_path": str(self.strategy_path), "phase": self.policy.phase,
                "settings_id": self._applied_id}

    def run(self) -> None:
        self._controller.start()
        super().run()

    def close(self) -> None:
        self._controller.join(timeout=5)
        with self._lock:
            self._persist()
        self.db.close()

    def _migrate(self) -> None:
        """Feedback tables from before self-optimization lack the settings_id column."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(feedback)")}
        if "settings_id" not in columns:
            self.db.execute("ALTER TABLE feedback ADD COLUMN settings_id TEXT")

    # --- handlers (service worker thread) ------------------------------------------------------
    def _feedback(self, req: Request, emit: Emitter) -> dict:
        b = req.body
        with self._lock:
            settings_id = self._applied_id
            self.policy.outcome(bool(b["success"]))
        with self._lock, self.db:  # the transaction commits (and fsyncs) before the ack is sent
            self.db.execute("INSERT INTO feedback (ts, session_id, success, error_reason, details, settings_id) "
                            "VALUES (?, ?, ?, ?, ?, ?)",
                            (time.time(), b["session_id"], int(b["success"]), b.get("error_reason"),
                             json.dumps(b.get("details") or {}, default=str), settings_id))
            row_id = self.db.last_insert_rowid()
            # Bounded: anyone allowed to send feedback could otherwise fill the disk a row at a time.
            self.db.execute("DELETE FROM feedback WHERE id <= ?", (row_id - self.config.optimizer.max_feedback_rows,))
        self.log.info("feedback", session=b["session_id"], success=b["success"], id=row_id, settings_id=settings_id,
                      error_reason=(b.get("error_reason") or "")[:200])
        return {"id": row_id, "durable": True, "queued_for": "optimizer", "settings_id": settings_id}

    def _stats(self, req: Request, emit: Emitter) -> dict:
        with self._lock:
            total, ok = self.db.execute("SELECT count(*), coalesce(sum(success), 0) FROM feedback").fetchone()
            reasons = self.db.execute("SELECT error_reason, count(*) AS n FROM feedback WHERE success = 0 "
                                      "GROUP BY error_reason ORDER BY n DESC LIMIT 5").fetchall()
            per_strategy = self.db.execute("SELECT settings_id, coalesce(sum(success), 0), count(*) FROM feedback "
                                           "GROUP BY settings_id ORDER BY count(*) DESC LIMIT 20").fetchall()
        return {"total": total, "succeeded": ok, "failed": total - ok,
                "top_errors": [{"reason": r, "count": n} for r, n in reasons],
                "by_strategy": [{"settings_id": sid, "succeeded": s, "failed": n - s} for sid, s, n in per_strategy]}

    def _telemetry(self, req: Request, emit: Emitter) -> dict:
        """Queue each valid sample; a bad one is rejected alone (counted, its reason in ``errors``)."""
        service, pid = req.body["service"], req.body.get("pid")
        if service not in _REPORTING:  # the dicts keyed by service name stay this small
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"telemetry from unknown service {service[:64]!r} "
                                                       f"(known: {', '.join(_REPORTING)})")
        checked: list[tuple[str, Callable[[Any], dict], Any]] = [
            (f"samples[{i}]", validate_sample, s) for i, s in enumerate(req.body.get("samples") or [])]
        if req.body.get("system") is not None:
            checked.append(("system", validate_system, req.body["system"]))
        accepted, errors = 0, []
        for where, validate, raw in checked:
            try:
                sample = validate(raw)
            except ValueError as err:
                errors.append(f"{where}: {err}")
                continue
            if validate is validate_system:
                sample["type"] = "_system"
            try:
                self._samples.put_nowait((service, pid, sample))
                accepted += 1
            except queue.Full:
                break
        if errors:
            self.log.warning("telemetry_rejected", service=service, rejected=len(errors), first=errors[0][:200])
        return {"accepted": accepted, "rejected": len(errors), "errors": errors[:_REPORTED_ERRORS]}

    def _strategy_get(self, req: Request, emit: Emitter) -> dict:
        with self._lock:
            return {"strategy": self._strategy().model_dump(mode="json"), "path": str(self.strategy_path)}

    def _strategy_set(self, req: Request, emit: Emitter) -> dict:
        try:
            new = strategy_file.parse(req.body["strategy"])
        except strategy_file.StrategyRejected as err:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"strategy rejected: {err}") from None
        with self._lock:
            self._restore(new)
            self._persist()
            self.log.info("strategy_set", settings=new.settings.given(), settled=new.settled)
            return {"strategy": self._strategy().model_dump(mode="json"), "path": str(self.strategy_path)}

    def _status(self, req: Request, emit: Emitter) -> dict:
        with self._lock:
            return {**self.policy.status(), "applied": self._applied, "settings_id": self._applied_id,
                    "inference_pid": self._inference_pid, "thermal": self._thermal,
                    "relief_level": self.relief.level, "processes": dict(self._processes)}

    def _advice(self, req: Request, emit: Emitter) -> dict:
        if not req.session:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "optimizer.advice needs a session id in the envelope")
        with self._lock:
            return self.speeds.advice(req.session)

    # --- strategy state (callers hold the lock) -----------------------------------------------
    def _strategy(self) -> strategy_file.Strategy:
        ref = self.policy.reference
        return strategy_file.Strategy(
            settings=self.policy.incumbent, settings_id=self._applied_id if self.policy.trial is None else None,
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

    # --- the controller thread ------------------------------------------------------------
    def _control_loop(self) -> None:
        inference = Client.for_service("inference", self.config, timeout_s=120.0)
        due = {"apply": 0.0, "thermal": 0.0, "probe": 0.0, "last_persist": time.monotonic()}
        while not self._stopping.is_set():
            try:
                self._control_step(inference, due)
            except Exception:  # a bug here must not end tuning for the life of the process
                self.log.error("controller_failed", exc_info=True)
                self._stopping.wait(1.0)
        inference.close()

    def _control_step(self, inference: Client, due: dict[str, float]) -> None:
        """One turn: ingest samples, read the board, notice an inference restart, apply, persist."""
        self._ingest(timeout_s=0.5)
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

    def _ingest(self, timeout_s: float) -> None:
        """Feed queued samples to the policy and the signals."""
        try:
            batch = [self._samples.get(timeout=timeout_s)]
        except queue.Empty:
            return
        while len(batch) < 2000:
            try:
                batch.append(self._samples.get_nowait())
            except queue.Empty:
                break
        with self._lock:
            for service, pid, sample in batch:
                self._take_sample(service, pid, sample)

    def _take_sample(self, service: str, pid: int | None, sample: dict) -> None:
        if service == "inference" and pid is not None and pid != self._inference_pid:
            if self._inference_pid is not None:
                self.log.info("inference_restarted", old_pid=self._inference_pid, pid=pid)
                self._applied = None  # a fresh process runs its config defaults: push the strategy again
            self._inference_pid = pid
        kind = sample.get("type")
        if kind == "_system":
            self._processes[service] = {"pid": pid, **{k: v for k, v in sample.items() if k != "type"}}
        elif "latency_s" in sample:  # the generic sample every service loop reports
            alert = self.alarm.add(service, float(sample["latency_s"]))
            if alert:
                self.log.warning("latency_alert", **alert)
            strategy_failure = sample.get("code") == ErrorCode.INTERNAL  # not the client's bad_request or busy
            if service == "inference" and kind == "generate" and self.relief.level == 0 and (
                    sample.get("ok") or strategy_failure):
                self.policy.outcome(bool(sample.get("ok")))
        elif kind == "generation":  # the inference result of one finished generate
            self.speeds.add(sample.get("session"), int(sample.get("completion_tokens") or 0), sample.get("decode_tps"))
            if self.relief.level == 0 and self._applied is not None and self.config.engine.self_optimize:
                before = self.policy.phase, self.policy.trial
                if self.policy.add(sample):
                    self._dirty = True
                if (self.policy.phase, self.policy.trial) != before:
                    self.log.info("optimizer_decision", phase=self.policy.phase, trial=self.policy.trial,
                                  last=self.policy.decisions[-1].__dict__ if self.policy.decisions else None)

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
            pid = inference.health().get("pid")
        except ServiceError:
            return
        with self._lock:
            self._take_sample("inference", pid, {"type": "_probe"})

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
            self._applied_id = reply.get("settings_id")
            self.policy.applied(self._applied, self._applied_id, bool(reply.get("reloaded")))
            self._dirty = True
        self.log.info("engine_configured", settings=self._applied, settings_id=self._applied_id,
                      reloaded=bool(reply.get("reloaded")))
        self._probe_inference(inference)  # learn the pid this configuration went to
        return True
