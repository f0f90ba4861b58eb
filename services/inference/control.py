"""The inference service's engine work: control messages (``engine.configure``, ``model.*``) and the session
messages. All of it runs on the scheduler's thread, between decode steps, since it touches the engines."""

from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError

from shared.config import KNOBS, REBUILD_KNOBS, Config, EngineConfig, error_lines
from shared.protocol import ErrorCode, ProtocolError, Request
from services.inference.engine import settings_id
from services.inference.models import ModelPool
from services.inference.resident import ResidentModel


def owner(req: Request) -> str:
    """Whose KV a request may reuse: its peer, refined by the tenant a relaying peer names."""
    return f"{req.peer}|{req.owner}" if req.owner else req.peer


def session_key(req: Request) -> tuple[str, str] | None:
    return None if req.session is None else (owner(req), req.session)


class EngineControl:
    """Answers the messages that change or describe the engines."""

    def __init__(self, config: Config, models: ModelPool[ResidentModel], log: Any):
        self.config, self.models, self.log = config, models, log
        self.handlers = {"engine.configure": self.on_configure, "model.load": self.on_model_load,
                         "model.unload": self.on_model_unload, "model.switch": self.on_model_switch}

    def settings(self) -> dict:
        resident = next(iter(self.models.resident.values()), None)
        if resident is not None:
            return resident.engine.settings()
        return {name: getattr(self.config.engine, name) for name in KNOBS}

    def needs_drain(self, req: Request) -> bool:
        """Everything but a configure of hot settings waits until no generation runs."""
        if req.type != "engine.configure":
            return True
        settings = req.body.get("settings") or {}
        return any(settings.get(k, getattr(self.config.engine, k)) != getattr(self.config.engine, k)
                   for k in REBUILD_KNOBS)

    def run(self, req: Request) -> dict:
        """A control message's reply; a missing model file is the client's problem (not_found)."""
        try:
            return self.handlers[req.type](req)
        except FileNotFoundError as exc:
            raise ProtocolError(ErrorCode.NOT_FOUND, str(exc)) from None

    # --- the session messages (registered as ordinary handlers) -----------------------------
    def on_session_drop(self, req: Request, _) -> dict:
        if req.session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "session.drop needs a session id in the envelope")
        key = session_key(req)
        return {"dropped": any([m.sessions.drop(key) for m in self.models.resident.values()])}

    def on_sessions(self, req: Request, _) -> dict:
        default = self.models.get(None)[0]  # loaded if it is not resident
        return default.sessions.describe(session_key(req))

    def on_model_list(self, req: Request, _) -> dict:
        return self.models.describe()

    # --- control messages ------------------------------------------------------------------
    def on_configure(self, req: Request) -> dict:
        settings = req.body["settings"]
        unknown = sorted(set(settings) - set(KNOBS))
        if unknown:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"not tunable: {', '.join(map(str, unknown))} "
                                                       f"(tunable: {', '.join(KNOBS)})")
        n_threads, cpus = settings.get("n_threads"), os.cpu_count() or 1
        if isinstance(n_threads, int) and n_threads > cpus:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"n_threads {n_threads} is more than the {cpus} CPUs")
        try:
            cfg = EngineConfig.model_validate({**self.config.engine.model_dump(), **settings})
        except ValidationError as err:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad settings: {'; '.join(error_lines(err))}") from None
        reloaded = self.models.reconfigure(cfg, lambda model, c: model.reconfigure(c))
        self.config.engine = cfg
        current = self.settings()
        self.log.info("engine_configured", settings=current, reloaded=reloaded)
        return {"settings": current, "reloaded": reloaded, "settings_id": settings_id(current)}

    def on_model_load(self, req: Request) -> dict:
        _, ms = self.models.get(req.body["name"])
        self.log.info("model_loaded", model=req.body["name"], load_ms=ms)
        return {"name": req.body["name"], "load_ms": ms, **self.models.describe()}

    def on_model_unload(self, req: Request) -> dict:
        return {"unloaded": self.models.unload(req.body["name"])}

    def on_model_switch(self, req: Request) -> dict:
        ms = self.models.switch(req.body["name"])
        self.log.info("model_switched", model=req.body["name"], switch_ms=ms)
        return {"default": self.models.default, "switch_ms": ms}
