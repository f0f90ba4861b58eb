"""The inference process: protocol handlers, preparing workers (``prepare.py``), the scheduler and a pool of models.

Three kinds of work, on three kinds of thread, like llama.cpp's server (HTTP threads prepare, one loop decodes):

* the runtime's thread (``shared/service/``) receives frames, answers ``health``, ``metrics`` and ``cancel``;
* ``PREPARING_WORKERS`` preparing workers take requests off the service queue: a ``generate`` or ``chat``
  becomes a ``GenerationRequest`` value (template, tokens, constraint, all compiled here), ``tokenize`` is
  answered here; the rest (control messages, sessions) is passed on (``handover.py``);
* the scheduler's thread owns every engine: it runs the prepared generations (``scheduler.py``), control
  messages (``engine.configure``, ``model.*``, ``control.py``) between decode steps, in order with the
  generations around them, and the session messages. It never runs this module's code. On drain every session's KV is written to ``DATA_DIR/sessions``
  (``session_store.py``) and comes back on the session's next request after the restart.

Who owns a request (``owner``) decides whose KV it may reuse: the CURVE identity of its peer, or the local
account, refined by the ``owner`` a relaying peer names (the gateway: the API key's name, or one name for all
keyless callers; the router takes it only from a peer that may send privileged messages). Each client
(that owner, else the connection) has at most ``runtime.max_generations_per_client`` generations in flight, so
the gateway's callers, which borrow pooled connections, are counted by who they are.
"""

from __future__ import annotations

from shared.config import Config
from shared.cores import stack_lease
from shared.protocol import Request
from shared.service import Job, Service, Sink
from services.inference.control import EngineControl, owner
from services.inference.engine import settings_id
from services.inference.handover import ClientLimits, Handover
from services.inference.models import ModelPool
from services.inference.prepare import Preparer
from services.inference.resident import ResidentModel
from services.inference.scheduler import Scheduler

#: Handlers that never touch an engine: answered by the preparing workers themselves.
_OFF_LOOP = frozenset({"tokenize"})
#: Threads that prepare requests: two keep one slow request (a big schema) from delaying the next one.
PREPARING_WORKERS = 2


class InferenceService(Service):
    name = "inference"
    scheduled = frozenset({"generate", "chat", "engine.configure", "model.load", "model.unload", "model.switch"})

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        sessions_dir = config.runtime.resolved_data_dir() / "sessions"
        self.core_lease = stack_lease(config)  # one llama.cpp computation at a time, with the embedding service
        self.models = ModelPool(config.engine, lambda cfg: ResidentModel(cfg, sessions_dir, self.core_lease))
        self.scheduler = Scheduler(self.models, self.log)
        self.preparer = Preparer(config, self.models)
        self.preparer.warm_up()
        self.control = EngineControl(config, self.models, self.log)
        self.handover = Handover(self, config.runtime.queue_size, self.scheduler, self.control,
                                 ClientLimits(config.runtime.max_generations_per_client))
        self.handle("session.drop", self.control.on_session_drop)
        self.handle("sessions", self.control.on_sessions)
        self.handle("model.list", self.control.on_model_list)
        self.handle("tokenize", self.preparer.on_tokenize)

    def health_details(self) -> dict:
        default = self.models.resident.get(self.models.default)
        settings = self.control.settings()
        details = {"settings": settings, "settings_id": settings_id(settings), "n_ctx": self.config.engine.n_ctx,
                   "n_threads": settings["n_threads"], "default_model": self.models.default,
                   "models_resident": list(self.models.resident), "model_loads": self.models.loads,
                   "scheduler": self.scheduler.describe(), "generations_in_flight": self.handover.limits.in_flight()}
        details["max_batch_seen"] = details["scheduler"]["max_batch_seen"]
        if default is not None:
            details.update(model=default.engine.model_name, model_path=str(default.engine.model_path),
                           sessions_resident=sum(s.session is not None for s in default.sessions.slots))
        return details

    def close(self) -> None:
        if self._threads[0].is_alive():  # it saves the sessions as it ends (Handover.schedule): not yet
            self.log.warning("sessions_not_saved", reason="the scheduler is still running")
        self.models.close()
        self.core_lease.close()

    # --- the threads -----------------------------------------------------------------------
    def worker_loops(self):
        """The scheduler's thread first (``close`` asks whether it still runs), then the preparing workers."""
        return [self.handover.schedule] + [self.work_loop] * PREPARING_WORKERS

    def serve(self, job: Job, sink: Sink) -> None:
        """On a preparing worker: a generation is prepared and handed to the scheduler's thread, and so is
        engine work; what touches no engine (``tokenize``) is answered here."""
        req = job.request
        if req.type in _OFF_LOOP:
            return self.run_job(job, sink)
        if req.type not in ("generate", "chat"):
            return self.handover.put(job)
        client = self._client(job)
        try:
            self.handover.limits.enter(client)
        except Exception as exc:
            return self.answer(job, sink).fail(exc)
        outlet = self.handover.outlet(job, client)
        try:
            generation = self.preparer.prepare(req, owner(req), outlet)
        except Exception as exc:
            self.handover.limits.leave(client)
            return self.answer(job, sink).fail(exc)
        self.handover.put(generation)

    @staticmethod
    def _client(job: Job) -> str:
        """The client a generation counts against: the named tenant or CURVE identity, else the connection."""
        req: Request = job.request
        if req.owner or req.peer != "local":
            return owner(req)
        return "connection:" + job.header[0].hex()
