"""The inference process: protocol handlers, preparing workers (``prepare.py``), the scheduler and a pool of models.

Three kinds of work, on three kinds of thread, like llama.cpp's server (HTTP threads prepare, one loop decodes):

* the service loop (``shared/service.py``) receives frames, answers ``health``, ``metrics`` and ``cancel``;
* ``PREPARING_WORKERS`` preparing workers take requests off the service queue: a ``generate`` or ``chat``
  becomes a ``GenerationRequest`` value (template, tokens, constraint, all compiled here), ``tokenize`` is
  answered here; the rest (control messages, sessions) is passed on;
* the scheduler's thread owns every engine: it runs the prepared generations (``scheduler.py``), control
  messages (``engine.configure``, ``model.*``) between decode steps, in order with the generations around them,
  and the session messages. On drain every session's KV is written to ``DATA_DIR/sessions``
  (``session_store.py``) and comes back on the session's next request after the restart.

Who owns a request (``owner``) decides whose KV it may reuse: the CURVE identity of its peer, or the local
account, refined by the ``owner`` a relaying peer names (the gateway: the API key's name). Each client (that
owner, else the connection) has at most ``runtime.max_generations_per_client`` generations in flight.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter

import zmq
from pydantic import ValidationError

from shared.config import KNOBS, REBUILD_KNOBS, Config, EngineConfig, error_lines
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Job, Service
from services.inference.engine import Engine, settings_id
from services.inference.models import ModelPool
from services.inference.prepare import Preparer
from services.inference.scheduler import Control, GenerationRequest, Scheduler

#: Messages that change engines: they run between decode steps, in order with the generations around them.
_CONTROL = frozenset({"engine.configure", "model.load", "model.unload", "model.switch"})
#: Handlers that never touch an engine: answered by the preparing workers themselves.
_OFF_LOOP = frozenset({"tokenize"})
#: Threads that prepare requests: two keep one slow request (a big schema) from delaying the next one.
PREPARING_WORKERS = 2


class InferenceService(Service):
    name = "inference"
    scheduled = frozenset({"generate", "chat"}) | _CONTROL

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        sessions_dir = config.runtime.resolved_data_dir() / "sessions"
        self.models = ModelPool(config.engine, lambda cfg: Engine(cfg, sessions_dir))
        self.scheduler = Scheduler(self.models, self.log)
        self.preparer = Preparer(config, self.models)
        self.preparer.warm_up()
        # Prepared generations and engine work, for the scheduler's thread (bounded: back-pressure reaches the
        # service queue, which answers busy).
        self._ready: queue.Queue[GenerationRequest | Job] = queue.Queue(maxsize=config.runtime.queue_size)
        self._decode_out: zmq.Socket | None = None  # the scheduler thread's reply socket (its callbacks send)
        self._clients: Counter[str] = Counter()  # generations in flight per client
        self._lock = threading.Lock()
        self.handle("session.drop", self.on_session_drop)
        self.handle("sessions", lambda req, _: self.engine.sessions.describe(self._session_key(req)))
        self.handle("model.list", lambda req, _: self.models.describe())
        self.handle("tokenize", lambda req, _: {"tokens": self.preparer.lexicon(None)[1].tokenize(req.body["text"])})
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
                   "scheduler": self.scheduler.describe(), "generations_in_flight": sum(self._clients.values())}
        details["max_batch_seen"] = details["scheduler"]["max_batch_seen"]
        if engine is not None:
            details.update(model=engine.model_name, model_path=str(engine.model_path),
                           sessions_resident=sum(s.session is not None for s in engine.sessions.slots))
        return details

    def close(self) -> None:
        if self._workers[0].is_alive():  # the scheduler still owns the engines: writing them now would race
            self.log.warning("sessions_not_saved", reason="the scheduler is still running")
        else:
            self.log.info("sessions_saved", sessions=self.scheduler.persist())
        self.models.close()

    def _settings(self) -> dict:
        engine = next(iter(self.models.engines.values()), None)
        if engine is not None:
            return engine.settings()
        return {name: getattr(self.config.engine, name) for name in KNOBS}

    @staticmethod
    def owner(req: Request) -> str:
        """Whose KV a request may reuse: its peer, refined by the tenant a relaying peer names."""
        return f"{req.peer}|{req.body['owner']}" if req.body.get("owner") else req.peer

    def _session_key(self, req: Request) -> tuple[str, str] | None:
        return None if req.session is None else (self.owner(req), req.session)

    # --- the threads -----------------------------------------------------------------------
    def worker_loops(self):
        """The scheduler's thread first (``close`` asks whether it still runs), then the preparing workers."""
        return [self._schedule] + [self.work_loop] * PREPARING_WORKERS

    def _schedule(self, out: zmq.Socket) -> None:
        self._decode_out = out
        self.scheduler.run(self._intake, self._drained)

    def _drained(self) -> bool:
        """Stopping, and every request taken off the queue has had its final reply (none is being prepared)."""
        return self.idle_and_stopping() and self._running_jobs == 0

    def _intake(self, wait_s: float) -> None:
        """Move prepared work into the scheduler (bounded: beyond that the queues fill and the service answers
        ``busy``); run the session messages right away, between steps."""
        self.beat()
        while len(self.scheduler.queue) < self.config.runtime.queue_size:
            try:
                item = self._ready.get(timeout=wait_s) if wait_s else self._ready.get_nowait()
            except queue.Empty:
                return
            wait_s = 0
            if isinstance(item, GenerationRequest):
                self.scheduler.submit(item)
            elif item.request.type in _CONTROL:
                self.scheduler.submit(Control(lambda job=item: self._run_control(job, self._decode_out),
                                              lambda job=item: self._needs_drain(job.request)))
            else:
                self.run_job(item, self._decode_out)

    def serve(self, job: Job, out: zmq.Socket) -> None:
        """On a preparing worker: a generation is prepared and handed to the scheduler's thread, and so is
        engine work; what touches no engine (``tokenize``) is answered here."""
        req = job.request
        if req.type in _OFF_LOOP:
            return self.run_job(job, out)
        if req.type not in ("generate", "chat"):
            return self._hand_over(job)
        client = self._client(job)
        try:
            self._enter(client)
        except ProtocolError as exc:
            return self.fail(job, out, exc)
        try:
            generation = self.preparer.prepare(
                req, self.owner(req),
                on_text=(lambda body: self._send(job, "event", body)) if req.body.get("stream") else None,
                send_ok=lambda body: self._finished(job, client, body),
                on_error=lambda exc: self._failed(job, client, exc),
                cancelled=lambda: self.is_cancelled(req.key))
        except Exception as exc:
            self._leave(client)
            return self.fail(job, out, exc)
        self._hand_over(generation)

    def _hand_over(self, item: GenerationRequest | Job) -> None:
        """To the scheduler's thread; waits (beating) while its queue is full."""
        while True:
            self.beat()
            try:
                return self._ready.put(item, timeout=0.2)
            except queue.Full:
                continue

    # --- who may have how many generations in flight -----------------------------------
    def _client(self, job: Job) -> str:
        """The client a generation counts against: the named tenant or CURVE identity, else the connection."""
        req = job.request
        if req.body.get("owner") or req.peer != "local":
            return self.owner(req)
        return "connection:" + job.header[0].hex()

    def _enter(self, client: str) -> None:
        limit = self.config.runtime.max_generations_per_client
        with self._lock:
            if self._clients[client] >= limit:
                raise ProtocolError(ErrorCode.BUSY, f"this client has {limit} generations in flight "
                                                    "(runtime.max_generations_per_client); retry when one ends")
            self._clients[client] += 1

    def _leave(self, client: str) -> None:
        with self._lock:
            self._clients[client] -= 1
            if self._clients[client] <= 0:
                del self._clients[client]

    # --- replies, sent from the scheduler's thread -----------------------------------------
    def _send(self, job: Job, kind: str, body: dict) -> None:
        self.replier(job, self._decode_out)(kind, body)

    def _finished(self, job: Job, client: str, result: dict) -> None:
        self._leave(client)
        result["settings_id"] = settings_id(self._settings())
        self.log.info(job.request.type, session=job.request.session, request_id=job.request.id,
                      **{k: v for k, v in result.items() if k not in ("text", "message")})
        self.metrics.observe_generation(result)
        self._send(job, "ok", result)
        stats = {k: v for k, v in result.items() if k not in ("text", "message")}
        self.telemetry.report(dict(stats, type="generation", session=job.request.session, ok=True))

    def _failed(self, job: Job, client: str, exc: Exception) -> None:
        self._leave(client)
        self.fail(job, self._decode_out, exc)

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

    def on_session_drop(self, req: Request, _) -> dict:
        if req.session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "session.drop needs a session id in the envelope")
        key = self._session_key(req)
        return {"dropped": any([e.sessions.drop(key) for e in self.models.engines.values()])}

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
