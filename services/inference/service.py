"""The inference process: protocol handlers around one ``Engine``, with continuous batching.

Like llama.cpp's server loop: requests of different sessions share each decode
step (one llama_decode for every running generation), new requests join
between steps as slots free up, and finished ones leave. A request whose
session is already generating waits for it (one sequence, one writer).
"""

from __future__ import annotations

from collections import deque

import zmq

from shared import shm
from shared.config import Config
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service, Job
from services.inference.engine import Engine, Generation, GenerateParams


class InferenceService(Service):
    name = "inference"
    workers = 1  # one engine; concurrency comes from batching its slots
    scheduled = frozenset({"generate"})

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.engine = Engine(config.engine)
        self.handle("session.drop", self.on_session_drop)
        self.handle("sessions", lambda req, _: self.engine.sessions.describe(req.session))
        self.handle("tokenize", lambda req, _: {"tokens": self.engine.tokenize(req.body["text"])})

    def health_details(self) -> dict:
        return {"model": self.engine.model_name, "model_path": str(self.engine.model_path),
                "n_ctx": self.config.engine.n_ctx, "n_threads": self.engine.n_threads,
                "sessions_resident": sum(s.session is not None for s in self.engine.sessions.slots),
                "max_batch_seen": self.engine.max_batch_seen}

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

    def work_loop(self, out: zmq.Socket) -> None:
        running: list[tuple[Job, Generation]] = []
        waiting: deque[Job] = deque()  # generate requests whose session is busy, or no slot free
        while True:
            self._admit(out, running, waiting)
            self.set_running(len(running) + len(waiting))
            if not running:
                if not waiting and self.idle_and_stopping():
                    return
                continue
            try:
                self.engine.step([g for _, g in running])
            except Exception as exc:  # the decode failed: every generation in the batch is lost
                for job, _ in running:
                    self.fail(job, out, exc)
                running.clear()
            for job, g in [r for r in running if r[1].done]:
                running.remove((job, g))
                self._finished(job, g, out)

    def _admit(self, out: zmq.Socket, running: list, waiting: deque) -> None:
        """Start queued work while slots are free; block briefly only when there is nothing to do."""
        while len(running) < self.engine.max_parallel:
            if waiting and self.engine.sessions.can_admit(waiting[0].request.session):
                job = waiting.popleft()
            else:
                job = self.next_job(None if running or waiting else 0.2)
                if job is None:
                    return
                if job.request.type != "generate":
                    self.run_job(job, out)
                    continue
                if not self.engine.sessions.can_admit(job.request.session):
                    waiting.append(job)
                    return
            try:
                g = self._start(job, out)
            except Exception as exc:
                self.fail(job, out, exc)
                continue
            if g.done:
                self._finished(job, g, out)
            else:
                running.append((job, g))

    def _start(self, job: Job, out: zmq.Socket) -> Generation:
        req = job.request
        prompt, params = self._prompt(req), self._params(req.body)
        send = self.replier(job, out)
        on_text = (lambda text: send("event", {"text": text})) if req.body.get("stream") else None
        return self.engine.start(prompt, req.session, params, on_text)

    def _finished(self, job: Job, g: Generation, out: zmq.Socket) -> None:
        result = g.result()
        self.log.info("generate", session=job.request.session, request_id=job.request.id,
                      **{k: v for k, v in result.items() if k != "text"})
        self.replier(job, out)("ok", result)
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

    def on_session_drop(self, req: Request, _: Emitter) -> dict:
        if req.session is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "session.drop needs a session id in the envelope")
        return {"dropped": self.engine.sessions.drop(req.session)}
