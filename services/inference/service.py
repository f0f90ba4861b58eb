"""The inference process: protocol handlers around the scheduler (``scheduler.py``) and a pool of models.

A ``generate`` or ``chat`` request becomes a ``GenerationRequest`` for the scheduler (prompt, sampling parameters,
an optional constraint, and reply callbacks; a chat's prompt and constraint come from ``chat.py`` once the
scheduler has picked the model, whose template they need); the scheduler's loop runs on the service's one worker thread
and owns every engine. Control messages (``engine.configure``, ``model.*``) are queued in the same line, so
they run between decode steps; the rest (``tokenize``, ``sessions``, ``session.drop``, ``model.list``) runs at
once between steps. On drain every session's KV is written to ``DATA_DIR/sessions`` (``session_store.py``),
and comes back on the session's next request after the restart.
"""

from __future__ import annotations

import os

import zmq
from pydantic import ValidationError

from shared import shm
from shared.config import KNOBS, REBUILD_KNOBS, Config, EngineConfig, error_lines
from shared.grammar import check_grammar
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Job, Service
from services.inference.chat import Conversations
from services.inference.constraint import gbnf_constraint
from services.inference.engine import Engine, settings_id
from services.inference.models import ModelPool
from services.inference.scheduler import Control, GenerateParams, GenerationRequest, Scheduler

#: Messages that change engines: they run between decode steps, in order with the generations around them.
_CONTROL = frozenset({"engine.configure", "model.load", "model.unload", "model.switch"})
#: Well above the longest token text of any vocabulary: a prompt_shm longer than n_ctx of these cannot fit.
_MAX_BYTES_PER_TOKEN = 256


class InferenceService(Service):
    name = "inference"
    workers = 1  # one worker owns every engine; concurrency comes from batching their slots
    scheduled = frozenset({"generate", "chat"}) | _CONTROL

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        sessions_dir = config.runtime.resolved_data_dir() / "sessions"
        self.models = ModelPool(config.engine, lambda cfg: Engine(cfg, sessions_dir))
        self.scheduler = Scheduler(self.models, self.log)
        self.conversations = Conversations()
        self.handle("session.drop", self.on_session_drop)
        self.handle("sessions", lambda req, _: self.engine.sessions.describe(req.session))
        self.handle("tokenize", lambda req, _: {"tokens": self.engine.tokenize(req.body["text"])})
        self.handle("model.list", lambda req, _: self.models.describe())
        self._control = {"engine.configure": self.on_configure, "model.load": self.on_model_load,
                         "model.unload": self.on_model_unload, "model.switch": self.on_model_switch}

    @property
    def engine(self) -> Engine:
        """The default model's engine (loaded if it is not resident)."""
        return self.models.get(None)[0]

    def health_details(self) -> dict:
        engine = self.models.engines.get(self.models.default)
        settings = self._settings()
        details = {"settings": settings, "settings_id": settings_id(settings), "n_ctx": self.config.engine.n_ctx,
                   "n_threads": settings["n_threads"], "default_model": self.models.default,
                   "models_resident": list(self.models.engines), "model_loads": self.models.loads,
                   "scheduler": self.scheduler.describe()}
        details["max_batch_seen"] = details["scheduler"]["max_batch_seen"]
        if engine is not None:
            details.update(model=engine.model_name, model_path=str(engine.model_path),
                           sessions_resident=sum(s.session is not None for s in engine.sessions.slots))
        return details

    def close(self) -> None:
        if any(w.is_alive() for w in self._workers):  # it still owns the engines: writing them now would race
            self.log.warning("sessions_not_saved", reason="the worker is still running")
        else:
            self.log.info("sessions_saved", sessions=self.scheduler.persist())
        self.models.close()

    def _settings(self) -> dict:
        engine = next(iter(self.models.engines.values()), None)
        if engine is not None:
            return engine.settings()
        return {name: getattr(self.config.engine, name) for name in KNOBS}

    # --- the loop: the scheduler's, fed from the service queue ---------------------------
    def work_loop(self, out: zmq.Socket) -> None:
        self.scheduler.run(lambda wait_s: self._intake(out, wait_s), self.idle_and_stopping)

    def _intake(self, out: zmq.Socket, wait_s: float) -> None:
        """Move queued requests into the scheduler (bounded: beyond that the service queue fills and answers
        ``busy``); run the quick handlers right away, between steps."""
        job = self.next_job(wait_s)
        while job is not None:
            if job.request.type in ("generate", "chat"):
                self._submit_generation(job, out)
            elif job.request.type in _CONTROL:
                self.scheduler.submit(Control(lambda job=job: self._run_control(job, out),
                                              lambda job=job: self._needs_drain(job.request)))
            else:
                self.run_job(job, out)
            if len(self.scheduler.queue) >= self.config.runtime.queue_size:
                return
            job = self.next_job(0)

    def _submit_generation(self, job: Job, out: zmq.Socket) -> None:
        req = job.request
        send = self.replier(job, out)
        stream = (lambda body: send("event", body)) if req.body.get("stream") else None
        try:
            generation = GenerationRequest(
                prompt="", params=self._params(req.body), session=req.session, model=req.body.get("model"),
                on_done=lambda result: self._finished(job, result, send), on_error=lambda exc: self.fail(job, out, exc))
            if req.type == "chat":
                self._chat(job, generation, send, stream)
            else:
                generation.prompt = self._prompt(req)
                if grammar := req.body.get("grammar"):
                    check_grammar(grammar)  # refused here, before it waits in the queue
                    generation.constraint = lambda engine: gbnf_constraint(grammar, engine.model)
                if stream:
                    generation.on_text = lambda text: stream({"text": text})
        except Exception as exc:
            self.fail(job, out, exc)
            return
        self.scheduler.submit(generation)

    def _chat(self, job: Job, generation: GenerationRequest, send, stream) -> None:
        """The chat hook: the prompt (the model's own template) and the constraint (its vocabulary) are made
        once the scheduler has the model; the turn turns the result into the assistant message."""
        req = job.request

        def prepare(engine: Engine, model: str) -> None:
            turn = self.conversations.begin(req.body, req.session, engine, model, stream)
            generation.prompt, generation.on_text = turn.prompt, turn.on_text
            generation.constraint = lambda _: turn.constraint
            generation.on_done = lambda result: self._finished(job, result, send, turn.reply)

        generation.prepare = prepare

    def _finished(self, job: Job, result: dict, send, reply=lambda result: result) -> None:
        result["settings_id"] = settings_id(self._settings())
        self.log.info(job.request.type, session=job.request.session, request_id=job.request.id,
                      **{k: v for k, v in result.items() if k != "text"})
        self.metrics.observe_generation(result)
        send("ok", reply(result))
        self.telemetry.report(dict(result, text=None, type="generation", session=job.request.session, ok=True))

    def _params(self, body: dict) -> GenerateParams:
        p = GenerateParams(max_tokens=body.get("max_tokens") or self.config.engine.default_max_tokens)
        for name in ("temperature", "top_p", "top_k", "seed", "cache_prompt"):
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

    def _prompt(self, req: Request) -> str:
        if "prompt_shm" in req.body:
            try:
                cap = self.config.engine.n_ctx * _MAX_BYTES_PER_TOKEN  # more could never fit the context
                return shm.take_bytes(req.body["prompt_shm"], req.session, max_bytes=cap).decode()
            except UnicodeDecodeError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt_shm does not hold UTF-8 text")
        if "prompt" in req.body:
            return req.body["prompt"]
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing required field 'prompt' (or 'prompt_shm')")

    # --- control messages ------------------------------------------------------------------
    def _needs_drain(self, req: Request) -> bool:
        """Everything but a configure of hot settings waits until no generation runs."""
        if req.type != "engine.configure":
            return True
        settings = req.body.get("settings") or {}
        return any(settings.get(k, getattr(self.config.engine, k)) != getattr(self.config.engine, k)
                   for k in REBUILD_KNOBS)

    def _run_control(self, job: Job, out: zmq.Socket) -> None:
        try:
            self.replier(job, out)("ok", self._control[job.request.type](job.request))
        except Exception as exc:
            self.fail(job, out, _not_found(exc))

    def on_session_drop(self, req: Request, _: Emitter) -> dict:
        if req.session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "session.drop needs a session id in the envelope")
        self.conversations.forget(req.session)
        return {"dropped": any([e.sessions.drop(req.session) for e in self.models.engines.values()])}

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
        reloaded = self.models.reconfigure(cfg, lambda engine, c: engine.reconfigure(c))
        self.config.engine = cfg
        current = self._settings()
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


def _not_found(exc: Exception) -> Exception:
    """A missing model file is the client's problem (not_found), not the service's."""
    if isinstance(exc, FileNotFoundError):
        return ProtocolError(ErrorCode.NOT_FOUND, str(exc))
    return exc
