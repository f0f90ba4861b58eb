"""The inference process: protocol handlers around one ``Engine``."""

from __future__ import annotations

from shared import shm
from shared.config import Config
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service
from services.inference.engine import Engine, GenerateParams


class InferenceService(Service):
    name = "inference"
    workers = 1  # one engine, one request at a time: the queue orders the rest

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.engine = Engine(config.engine)
        self.handle("generate", self.on_generate)
        self.handle("session.drop", self.on_session_drop)
        self.handle("sessions", lambda req, _: self.engine.sessions.describe(req.session))
        self.handle("tokenize", lambda req, _: {"tokens": self.engine.tokenize(req.body["text"])})

    def health_details(self) -> dict:
        return {"model": self.engine.model_name, "model_path": str(self.engine.model_path),
                "n_ctx": self.config.engine.n_ctx, "n_threads": self.engine.n_threads,
                "sessions_resident": sum(s.session is not None for s in self.engine.sessions.slots)}

    def close(self) -> None:
        self.engine.close()

    def _params(self, body: dict) -> GenerateParams:
        p = GenerateParams(max_tokens=body.get("max_tokens") or self.config.engine.default_max_tokens)
        for name in ("temperature", "top_p", "top_k", "seed", "grammar"):
            if body.get(name) is not None:
                setattr(p, name, body[name])
        if not 1 <= p.max_tokens <= 32768:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "max_tokens must be in 1..32768")
        if not 0 <= p.temperature <= 5 or not 0 < p.top_p <= 1 or p.top_k < 0:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "need 0<=temperature<=5, 0<top_p<=1, top_k>=0")
        stop = body.get("stop") or []
        if not all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "stop must be a list of non-empty strings (<=256 chars)")
        p.stop = stop
        return p

    def on_generate(self, req: Request, emit: Emitter) -> dict:
        if "prompt_shm" in req.body:
            try:
                prompt = shm.take_bytes(req.body["prompt_shm"], req.session).decode()
            except UnicodeDecodeError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt_shm does not hold UTF-8 text")
        elif "prompt" in req.body:
            prompt = req.body["prompt"]
        else:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "missing required field 'prompt' (or 'prompt_shm')")
        params = self._params(req.body)
        on_text = (lambda text: emit.event({"text": text})) if req.body.get("stream") else None
        result = self.engine.generate(prompt, req.session, params, on_text)
        self.log.info("generate", session=req.session, request_id=req.id,
                      **{k: v for k, v in result.items() if k != "text"})
        return result

    def on_session_drop(self, req: Request, _: Emitter) -> dict:
        if req.session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "session.drop needs a session id in the envelope")
        return {"dropped": self.engine.sessions.drop(req.session)}
