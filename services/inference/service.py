"""The inference process: protocol handlers around a pool of ``Engine``s, with continuous batching.

Like llama.cpp's server loop: requests of different sessions share each decode
step (one llama_decode per resident model for every running generation), new
requests join between steps as slots free up, and finished ones leave. A
request whose session is already generating waits for it (one sequence, one
writer). Requests name a model (``model``, default: the pool's default); each
resident model has its own context and session slots.

Control messages that change engines (``engine.configure``, ``model.*``) run
between decode steps once no generation is running: new work waits behind
them in order, so a context rebuild or a model swap loses no request.
"""

from __future__ import annotations

import os
import time
from collections import deque

import zmq
from pydantic import ValidationError

from shared import shm
from shared.config import KNOBS, Config, EngineConfig
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service, Job
from services.inference.engine import Engine, Generation, GenerateParams, settings_id
from services.inference.chat import Conversations
from services.inference.models import ModelPool

#: Messages that must run while no generation is running (they rebuild, load or free engines).
_CONTROL = frozenset({"engine.configure", "model.load", "model.unload", "model.switch"})


class InferenceService(Service):
    name = "inference"
    workers = 1  # one worker owns every engine; concurrency comes from batching their slots
    scheduled = frozenset({"generate", "chat"}) | _CONTROL

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.models = ModelPool(config.engine, Engine)
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
                   "models_resident": list(self.models.engines), "model_loads": self.models.loads}
        if engine is not None:
            details.update(model=engine.model_name, model_path=str(engine.model_path),
                           sessions_resident=sum(s.session is not None for s in engine.sessions.slots),
                           max_batch_seen=engine.max_batch_seen)
        return details

    def close(self) -> None:
        self.models.close()

    def _settings(self) -> dict:
        engine = next(iter(self.models.engines.values()), None)
        if engine is not None:
            return engine.settings()
        return {name: getattr(self.config.engine, name) for name in KNOBS}

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

    # --- the loop ------------------------------------------------------------------------
    def work_loop(self, out: zmq.Socket) -> None:
        running: list[tuple[Job, Engine, Generation]] = []
        waiting: deque[Job] = deque()  # jobs that cannot start yet: session busy, no slot free, or control
        while True:
            self._admit(out, running, waiting)
            self.set_running(len(running) + len(waiting))
            if not running:
                if not waiting and self.idle_and_stopping():
                    return
                continue
            for engine in {id(e): e for _, e, _ in running}.values():
                try:
                    engine.step([g for _, e, g in running if e is engine])
                except Exception as exc:  # the decode failed: every generation of that engine is lost
                    for job, _, g in [r for r in running if r[1] is engine]:
                        running.remove((job, engine, g))
                        self.fail(job, out, exc)
            for job, engine, g in [r for r in running if r[2].done]:
                running.remove((job, engine, g))
                self._finished(job, g, out)
            pause_ms = self.config.engine.decode_pause_ms
            if pause_ms:
                time.sleep(pause_ms / 1000)

    def _admit(self, out: zmq.Socket, running: list, waiting: deque) -> None:
        """Start queued work while it can start; keep arrival order; block briefly only when idle."""
        while True:
            if waiting:
                job = waiting[0]
            else:
                job = self.next_job(None if running else 0.2)
                if job is None:
                    return
                if job.request.type not in self.scheduled:
                    self.run_job(job, out)
                    continue
                waiting.append(job)
            if job.request.type in _CONTROL:
                if running:
                    return  # runs once the generations in flight are done
                waiting.popleft()
                self._run_control(job, out)
                continue
            try:
                engine, load_ms = self.models.get(job.request.body.get("model"))
            except (ProtocolError, FileNotFoundError) as exc:
                waiting.popleft()
                if isinstance(exc, ProtocolError) and exc.code == ErrorCode.BUSY and running:
                    waiting.appendleft(job)  # every resident model is generating: wait for one to finish
                    return
                self.fail(job, out, _not_found(exc))
                continue
            if not engine.sessions.can_admit(job.request.session):
                return
            waiting.popleft()
            try:
                g = self._start(job, engine, load_ms, out)
            except Exception as exc:
                self.fail(job, out, exc)
                continue
            if g.done:
                self._finished(job, g, out)
            else:
                running.append((job, engine, g))

    def _run_control(self, job: Job, out: zmq.Socket) -> None:
        send = self.replier(job, out)
        try:
            send("ok", self._control[job.request.type](job.request))
        except Exception as exc:
            self.fail(job, out, _not_found(exc))

    def _start(self, job: Job, engine: Engine, load_ms: float, out: zmq.Socket) -> Generation:
        req = job.request
        params = self._params(req.body)
        send = self.replier(job, out)
        model = next(name for name, e in self.models.engines.items() if e is engine)
        stream = (lambda body: send("event", body)) if req.body.get("stream") else None
        chat = None
        if req.type == "chat":  # the chat hook: prompt tokens, a constraint in params, a turn that finishes it
            chat = self.conversations.begin(req.body, req.session, engine, model, params, stream)
            prompt, on_text = chat.prompt, chat.on_text
        else:
            prompt, on_text = self._prompt(req), (lambda text: stream({"text": text})) if stream else None
        g = engine.start(prompt, req.session, params, on_text)
        g.model, g.model_load_ms, g.chat = model, load_ms, chat
        return g

    def _finished(self, job: Job, g: Generation, out: zmq.Socket) -> None:
        result = g.result()
        settings = self._settings()
        result.update(model=g.model, model_load_ms=g.model_load_ms, settings_id=settings_id(settings))
        self.log.info(job.request.type, session=job.request.session, request_id=job.request.id,
                      **{k: v for k, v in result.items() if k != "text"})
        self.metrics.observe_generation(result)
        self.replier(job, out)("ok", g.chat.reply(result) if g.chat else result)
        self.telemetry.report(dict(result, text=None, type="generation", session=job.request.session, ok=True))

    def _prompt(self, req: Request) -> str:
        if "prompt_shm" in req.body:
            try:
                return shm.take_bytes(req.body["prompt_shm"], req.session).decode()
            except UnicodeDecodeError:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "prompt_shm does not hold UTF-8 text")
        if "prompt" in req.body:
            return req.body["prompt"]
        raise ProtocolError(ErrorCode.BAD_REQUEST, "missing required field 'prompt' (or 'prompt_shm')")

    # --- handlers ------------------------------------------------------------------------
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
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"bad settings: {problems}") from None
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
