"""One resident model, as the model pool (``models.ModelPool``) holds it and the scheduler runs it.

``Engine`` is the model and its context only (``engine.py``). What the scheduler keeps per model beside it
lives here, built when the pool loads the model and rebuilt with its context:

* ``sessions`` - which session's KV is in which sequence (``sessions.SessionTable``), with the sessions saved
  on drain (``session_store.SessionStore``, under ``sessions_dir``);
* ``step_costs`` - what a decode step of n tokens took (``drafting.StepCosts``): the scheduler measures them,
  its priority pace and the drafting read them;
* ``drafting`` - the drafting policy (``drafting.DraftPolicy``), with the draft model (``engine.draft_model_path``)
  on an engine of its own, which drafting sees only as an ``Evaluator``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from shared.config import EngineConfig
from shared.protocol import ErrorCode, ProtocolError
from services.inference.drafting import DraftModel, DraftPolicy, StepCosts
from services.inference.engine import Engine
from services.inference.session_store import SessionStore
from services.inference.sessions import SessionTable


class ResidentModel:
    def __init__(self, cfg: EngineConfig, sessions_dir: Path | None = None,
                 core_lease: contextlib.AbstractContextManager | None = None):
        """``sessions_dir``: where sessions are saved on drain (None: not saved). ``core_lease``: held around
        every decode of its engines (``Engine``)."""
        self.engine = Engine(cfg, core_lease)
        self.sessions_dir = sessions_dir
        try:
            self.draft_engine = self._open_draft_engine(cfg, core_lease) if cfg.draft_model_path else None
        except Exception:
            self.engine.close()
            raise
        self.drafting = DraftPolicy(cfg, DraftModel(self.draft_engine) if self.draft_engine else None)
        self._open_tables()

    def _open_draft_engine(self, cfg: EngineConfig, core_lease: contextlib.AbstractContextManager | None) -> Engine:
        """The draft model's engine: one sequence per target sequence, as the target's context has."""
        draft = Engine(self._draft_config(cfg), core_lease)
        if draft.n_vocab != self.engine.n_vocab:
            draft.close()
            raise ValueError(f"draft model {draft.model_path} has {draft.n_vocab} tokens in its vocabulary, "
                             f"the model it drafts for {self.engine.n_vocab}: they must share one tokenizer")
        return draft

    @staticmethod
    def _draft_config(cfg: EngineConfig) -> EngineConfig:
        return cfg.model_copy(update={"model_path": cfg.draft_model_path})

    def _open_tables(self) -> None:
        """What holds for one context only: its session table (and store) and its step costs."""
        cfg, engine = self.engine.cfg, self.engine
        store = None
        if self.sessions_dir is not None and cfg.session_disk_mb > 0:
            store = SessionStore(self.sessions_dir, engine.fingerprint(), cfg.session_disk_mb * 2**20)
        self.sessions = SessionTable(cfg.session_slots, cfg.session_cache_mb * 2**20, engine, store,
                                     share_prefixes=cfg.prefix_sharing)
        self.step_costs = StepCosts(cfg.max_batch_size)

    @property
    def memory_bytes(self) -> int:
        """Weights and KV state at full size, the draft model's included: what the model slots budget counts."""
        return self.engine.memory_bytes + (self.draft_engine.memory_bytes if self.draft_engine else 0)

    def busy(self) -> bool:
        """A generation runs, or waits paused with its KV in RAM (a rebuild or an unload would void that KV)."""
        return self.sessions.paused > 0 or any(slot.busy for slot in self.sessions.slots)

    def reconfigure(self, cfg: EngineConfig) -> bool:
        """Apply new settings to both engines and the drafting; True when the context was rebuilt, which
        forgets every session's cached KV (their next step prefills again): refused while one is in use."""
        if self.engine.needs_rebuild(cfg) and self.busy():
            raise ProtocolError(ErrorCode.BUSY, "cannot rebuild the context while a request is generating")
        rebuilt = self.engine.reconfigure(cfg)
        if rebuilt:
            self._open_tables()
        if self.draft_engine and self.draft_engine.reconfigure(self._draft_config(cfg)):
            self.drafting.model.forget()
        self.drafting.cfg = cfg
        return rebuilt

    def close(self) -> None:
        if self.draft_engine:
            self.draft_engine.close()
        self.engine.close()
