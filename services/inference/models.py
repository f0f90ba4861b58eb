"""Model slots: several named models resident in one inference process, bounded by count and memory.

Each resident model is a ``resident.ResidentModel`` (its engine: the weights,
memory-mapped, plus its own context; and its session slots), so switching between
resident models costs no reload: a request names its model and runs on it. Weights are mapped
from the GGUF file, so two slots of one file share their pages in the page
cache. When a model must come in and ``max_models`` or ``models_memory_mb``
would be exceeded, the least recently used idle model is unloaded first.

Models are opened through a factory so this bookkeeping is testable without
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


class Resident(Protocol):
    """What the pool needs of a resident model."""

    @property
    def memory_bytes(self) -> int: ...

    def busy(self) -> bool: ...
    def close(self) -> None: ...


#: The models a pool holds: ``ResidentModel`` in the service, fakes in tests.
ModelT = TypeVar("ModelT", bound=Resident)


class ModelPool(Generic[ModelT]):
    def __init__(self, cfg: EngineConfig, open_model: Callable[[EngineConfig], ModelT]):
        self.cfg = cfg
        self._open = open_model
        self.paths: dict[str, Path] = {DEFAULT_MODEL: cfg.resolved_model_path(), **cfg.models}
        self.resident: OrderedDict[str, ModelT] = OrderedDict()  # least recently used first
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
        return sum(e.memory_bytes for e in self.resident.values())

    def get(self, name: str | None) -> tuple[ModelT, float]:
        """The resident model of ``name`` (None = the default model) and the ms it took to load it (0 if resident)."""
        name = name or self.default
        self._known(name)
        model = self.resident.get(name)
        if model is not None:
            self.resident.move_to_end(name)
            return model, 0.0
        return self._load(name)

    def _load(self, name: str) -> tuple[ModelT, float]:
        t0 = time.perf_counter()
        path = self.paths[name]
        if not path.is_file():
            raise FileNotFoundError(f"model {name!r}: file {path} not found")
        size = path.stat().st_size
        # Make room by count first, and by the new model's file size; then by what it really takes.
        self._evict_until(lambda: len(self.resident) < self.cfg.max_models
                          and self.used_bytes() + size <= self.budget_bytes, name)
        model = self._open(self._engine_config(name))
        self.resident[name] = model
        self.loads += 1
        try:
            self._evict_until(lambda: self.used_bytes() <= self.budget_bytes, name)
        except ProtocolError:
            self.unload(name)
            raise
        return model, round((time.perf_counter() - t0) * 1000, 2)

    def _evict_until(self, fits: Callable[[], bool], incoming: str) -> None:
        while not fits():
            victim = next((n for n, e in self.resident.items() if n != incoming and not e.busy()), None)
            if victim is None:
                need = self.paths[incoming].stat().st_size / 2**20
                raise ProtocolError(ErrorCode.BUSY if self.resident.keys() - {incoming} else ErrorCode.BAD_REQUEST,
                                    f"model {incoming!r} does not fit: {need:.0f} MiB of weights, "
                                    f"{len(self.resident)} of {self.cfg.max_models} slots, budget "
                                    f"{self.cfg.models_memory_mb} MiB, nothing idle to unload")
            self.unload(victim)

    def unload(self, name: str) -> bool:
        """Close a resident model; False if it was not resident. Refused while it generates."""
        self._known(name)
        model = self.resident.get(name)
        if model is None:
            return False
        if model.busy():
            raise ProtocolError(ErrorCode.BUSY, f"model {name!r} is generating; unload it later")
        del self.resident[name]
        model.close()
        return True

    def switch(self, name: str) -> float:
        """Make ``name`` the model of requests that name none; returns the ms it took (0 if resident)."""
        _, ms = self.get(name)
        self.default = name
        return ms

    def reconfigure(self, cfg: EngineConfig, apply: Callable[[ModelT, EngineConfig], bool]) -> bool:
        """New settings for every resident model (and later loads); True if any context was rebuilt."""
        self.cfg = cfg
        return any([apply(model, self._engine_config(name)) for name, model in self.resident.items()])

    def describe(self) -> dict:
        return {
            "default": self.default,
            "max_models": self.cfg.max_models,
            "budget_mb": self.cfg.models_memory_mb,
            "used_mb": round(self.used_bytes() / 2**20, 1),
            "models": [{"name": n, "path": str(p), "resident": n in self.resident,
                        "memory_mb": round(self.resident[n].memory_bytes / 2**20, 1) if n in self.resident else None}
                       for n, p in sorted(self.paths.items())],
        }

    def close(self) -> None:
        for model in self.resident.values():
            model.close()
        self.resident.clear()
