"""The optimizer process: agent feedback (``feedback.py``), telemetry intake, and the tuning loop that configures
inference (``controller.py``).

Handlers (``feedback``, ``telemetry``, ``strategy.*``, ``optimizer.*``) run on the service worker: they check
what arrives, store feedback durably and queue telemetry samples; the ``Tuner``'s own thread does the slow parts.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.security import private_dir, session_ref
from shared.service import Emitter, Service
from shared.telemetry import NullTelemetry, Telemetry, validate_sample, validate_system
from services.optimizer import strategy as strategy_file
from services.optimizer.controller import Tuner
from services.optimizer.feedback import FeedbackStore

#: Processes whose telemetry is taken: every dict keyed by a sender's service name is bounded by this list.
_REPORTING = (*SERVICE_NAMES, WATCHDOG_NAME)
_REPORTED_ERRORS = 5  # rejected samples named in a reply


class OptimizerService(Service):
    name = "optimizer"

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        data_dir = config.runtime.resolved_data_dir()
        private_dir(data_dir)
        self.feedback = FeedbackStore(data_dir / "feedback.db", config.optimizer.max_feedback_rows)
        self.tuner = Tuner(config, config.optimizer.strategy_path or data_dir / "strategy.json", self.log)
        for msg_type, handler in (("feedback", self._feedback), ("feedback.stats", self._stats),
                                  ("telemetry", self._telemetry), ("strategy.get", self._strategy_get),
                                  ("strategy.set", self._strategy_set), ("optimizer.status", self._status),
                                  ("optimizer.advice", self._advice)):
            self.handle(msg_type, handler)
        self._controller = threading.Thread(target=self.tuner.run, args=(self._stopping,), name="optimizer-controller",
                                            daemon=True)

    def make_telemetry(self) -> Telemetry:
        return NullTelemetry()  # the optimizer must not report to itself

    def health_details(self) -> dict[str, Any]:
        return {"db_path": str(self.feedback.path), "strategy_path": str(self.tuner.strategy_path),
                "phase": self.tuner.policy.phase, "settings_id": self.tuner.applied_id}

    def run(self) -> None:
        self._controller.start()
        super().run()

    def close(self) -> None:
        self._controller.join(timeout=5)
        self.tuner.save()
        self.feedback.close()

    # --- handlers (service worker thread) ------------------------------------------------------
    def _feedback(self, req: Request, emit: Emitter) -> dict:
        b = req.body
        settings_id = self.tuner.outcome(bool(b["success"]))
        row_id = self.feedback.add(b["session_id"], bool(b["success"]), b.get("error_reason"), b.get("details"),
                                   settings_id)  # committed (and fsynced) before the ack is sent
        self.log.info("feedback", session=session_ref(b["session_id"]), success=b["success"], id=row_id,
                      settings_id=settings_id, error_reason=(b.get("error_reason") or "")[:200])
        return {"id": row_id, "durable": True, "queued_for": "optimizer", "settings_id": settings_id}

    def _stats(self, req: Request, emit: Emitter) -> dict:
        return self.feedback.stats()

    def _telemetry(self, req: Request, emit: Emitter) -> dict:
        """Queue each valid sample; a bad one is rejected alone (counted, its reason in ``errors``)."""
        service, origin = req.body["service"], (req.body.get("pid"), req.body.get("instance"))
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
            if not self.tuner.offer(service, origin, sample):
                break
            accepted += 1
        if errors:
            self.log.warning("telemetry_rejected", service=service, rejected=len(errors), first=errors[0][:200])
        return {"accepted": accepted, "rejected": len(errors), "errors": errors[:_REPORTED_ERRORS]}

    def _strategy_get(self, req: Request, emit: Emitter) -> dict:
        return self.tuner.strategy()

    def _strategy_set(self, req: Request, emit: Emitter) -> dict:
        try:
            new = strategy_file.parse(req.body["strategy"])
        except strategy_file.StrategyRejected as err:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"strategy rejected: {err}") from None
        return self.tuner.replace_strategy(new)

    def _status(self, req: Request, emit: Emitter) -> dict:
        return self.tuner.status()

    def _advice(self, req: Request, emit: Emitter) -> dict:
        if not req.session:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "optimizer.advice needs a session id in the envelope")
        return self.tuner.advice(req.session)
