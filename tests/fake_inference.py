"""A stand-in inference service for optimizer tests: answers engine.configure like the real one, no model.

Its ``health`` shows the settings it runs and every configure it received, so a
test can see what the optimizer pushed. Run: ``python -m tests.fake_inference --config F``.
"""

from __future__ import annotations

import hashlib
import json

from services.runner import run_service
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service

DEFAULTS = {"n_threads": 2, "prefill_chunk_size": 256, "spec_draft_tokens": 0, "decode_pause_ms": 0,
            "priority_pace": 0.8, "priority_aging_s": 30.0, "max_batch_size": 512, "kv_cache_type": "f16"}
REBUILD = {"max_batch_size", "kv_cache_type"}


class FakeInference(Service):
    name = "inference"

    def __init__(self, config, endpoint=None):
        super().__init__(config, endpoint)
        self.settings = dict(DEFAULTS)
        self.configures: list[dict] = []
        self.handle("engine.configure", self._configure)

    @property
    def settings_id(self) -> str:
        return hashlib.sha1(json.dumps(self.settings, sort_keys=True).encode()).hexdigest()[:12]

    def _configure(self, req: Request, emit: Emitter) -> dict:
        wanted = req.body["settings"]
        unknown = set(wanted) - set(DEFAULTS)
        if unknown:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"unknown settings {sorted(unknown)}")
        self.configures.append(dict(wanted))
        reloaded = any(self.settings[k] != v for k, v in wanted.items() if k in REBUILD)
        self.settings.update(wanted)
        return {"settings": dict(self.settings), "reloaded": reloaded, "settings_id": self.settings_id}

    def health_details(self) -> dict:
        return {"settings": dict(self.settings), "settings_id": self.settings_id, "configures": self.configures}


if __name__ == "__main__":
    run_service(FakeInference, "inference")
