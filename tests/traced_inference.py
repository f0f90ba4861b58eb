"""The real inference service, recording which functions its scheduler's thread runs: for
``tests/system/test_architecture.py`` (the scheduler never calls back into ``services/inference/service.py``).

Run: ``TRACE_OUT=F python -m tests.traced_inference --config F``; at exit F holds the (file, function) pairs.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from pathlib import Path

from services.inference.service import InferenceService
from services.runner import run_service

SCHEDULER_THREAD = "inference-worker-0"  # worker_loops() puts the scheduler's loop first
_seen: set[tuple[str, str]] = set()


def _profile(frame, event, arg) -> None:
    if event == "call" and threading.current_thread().name == SCHEDULER_THREAD:
        _seen.add((frame.f_code.co_filename, frame.f_code.co_name))


if __name__ == "__main__":
    threading.setprofile(_profile)
    atexit.register(lambda: Path(os.environ["TRACE_OUT"]).write_text(json.dumps(sorted(_seen))))
    run_service(InferenceService, "inference")
