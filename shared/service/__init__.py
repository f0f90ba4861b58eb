"""The process skeleton every Magnitude service shares: the runtime (``runtime.py``: lifecycle, drain, health,
metrics, watched threads), its ZeroMQ front (``zmq_router.py``) with its memory of accepted requests
(``retries.py``), the contract worker threads work to (``workers.py``), and ``Service`` (``service.py``), the
runtime with that front and handlers on worker threads."""

from shared.service.runtime import Runtime, Transport
from shared.service.service import Service
from shared.service.workers import Answer, Emitter, Handler, Job, Sink

__all__ = ["Answer", "Emitter", "Handler", "Job", "Runtime", "Service", "Sink", "Transport"]
