"""Model slots: several named models resident in one inference process, bounded by count and memory.

Each resident model is an ``Engine`` (its weights, memory-mapped, plus its own
context and session slots), so switching between resident models costs no
reload: a request names its model and runs on that engine. Weights are mapped
from the GGUF file, so two slots of one file share their pages in the page
cache. When a model must come in and ``max_models`` or ``models_memory_mb``
would be exceeded, the least recently used idle model is unloaded first.

Engines are opened through a factory so this bookkeeping is testable without
a model.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Generic, Protocol, TypeVar

from shared.config import EngineConfig
from shared.protocol import ErrorCode, ProtocolError

DEFAULT_MODEL = "default"


class ModelEngine(Protocol):
    @property
    def memory_bytes(self) -> int: ...

    def busy(self) -> bool: ...
    def close(self) -> None: ...


#: The engines a pool holds: ``Engine`` in the service, fakes in tests.
EngineT = TypeVar("EngineT", bound=ModelEngine)


class ModelPool(Generic[EngineT]):
    def __init__(self, cfg: EngineConfig, open_engine: Callable[[EngineConfig], EngineT]):
        self.cfg = cfg
        self._open = open_engine
        self.paths: dict[str, Path] = {DEFAULT_MODEL: cfg.resolved_model_path(), **cfg.models}
        self.engines: OrderedDict[str, EngineT] = OrderedDict()  # least recently used first
        self.default = DEFAULT_MODEL
        self.loads = 0  # models loaded since start (the first one included)
        self.budget_bytes = cfg.models_memory_mb * 2**20
        self.get(DEFAULT_MODEL)

    def _engine_config(self, name: str) -> EngineConfig:
        return self.cfg.model_copy(update={"model_path": self.paths[name]})

    def _known(self, name: str) -> None:
        if name not in self.paths:
            raise ProtocolError(ErrorCode.NOT_FOUND, f"no model {name[:64]!r} (configured: "
                                                     f"{', '.join(sorted(self.paths))})")

    def path_of(self, name: str) -> Path:
        """The file of a configured model; not_found for a name that is not configured."""
        self._known(name)
        return self.paths[name]

    def used_bytes(self) -> int:
        return sum(e.memory_bytes for e in self.engines.values())

    def get(self, name: str | None) -> tuple[EngineT, float]:
        """The engine of ``name`` (None = the default model) and the ms it took to load it (0 when resident)."""
        name = name or self.default
        self._known(name)
        engine = self.engines.get(name)
        if engine is not None:
            self.engines.move_to_end(name)
            return engine, 0.0
        return self._load(name)

    def _load(self, name: str) -> tuple[EngineT, float]:
        t0 = time.perf_counter()
        path = self.paths[name]
        if not path.is_file():
            raise FileNotFoundError(f"model {name!r}: file {path} not found")
        size = path.stat().st_size
        # Make room by count first, and by the new model's file size; then by what it really takes.
        self._evict_until(lambda: len(self.engines) < self.cfg.max_models
                          and self.used_bytes() + size <= self.budget_bytes, name)
        engine = self._open(self._engine_config(name))
        self.engines[name] = engine
        self.loads += 1
        try:
            self._evict_until(lambda: self.used_bytes() <= self.budget_bytes, name)
        except ProtocolError:
            self.unload(name)
            raise
        return engine, round((time.perf_counter() - t0) * 1000, 2)

    def _evict_until(self, fits: Callable[[], bool], incoming: str) -> None:
        while not fits():
            victim = next((n for n, e in self.engines.items() if n != incoming and not e.busy()), None)
            if victim is None:
                need = self.paths[incoming].stat().st_size / 2**20
                raise ProtocolError(ErrorCode.BUSY if self.engines.keys() - {incoming} else ErrorCode.BAD_REQUEST,
                                    f"model {incoming!r} does not fit: {need:.0f} MiB of weights, "
                                    f"{len(self.engines)} of {self.cfg.max_models} slots, budget "
                                    f"{self.cfg.models_memory_mb} MiB, nothing idle to unload")
            self.unload(victim)

    def unload(self, name: str) -> bool:
        """Close a resident model; False if it was not resident. Refused while it generates."""
        self._known(name)
        engine = self.engines.get(name)
        if engine is None:
            return False
        if engine.busy():
            raise ProtocolError(ErrorCode.BUSY, f"model {name!r} is generating; unload it later")
        del self.engines[name]
        engine.close()
        return True

    def switch(self, name: str) -> float:
        """Make ``name`` the model of requests that name none; returns the ms it took (0 if resident)."""
        _, ms = self.get(name)
        self.default = name
        return ms

    def reconfigure(self, cfg: EngineConfig, apply: Callable[[EngineT, EngineConfig], bool]) -> bool:
        """New settings for every resident model (and later loads); True if any context was rebuilt."""
        self.cfg = cfg
        return any([apply(engine, self._engine_config(name)) for name, engine in self.engines.items()])

    def describe(self) -> dict:
        return {
            "default": self.default,
            "max_models": self.cfg.max_models,
            "budget_mb": self.cfg.models_memory_mb,
            "used_mb": round(self.used_bytes() / 2**20, 1),
            "models": [{"name": n, "path": str(p), "resident": n in self.engines,
                        "memory_mb": round(self.engines[n].memory_bytes / 2**20, 1) if n in self.engines else None}
                       for n, p in sorted(self.paths.items())],
        }

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
