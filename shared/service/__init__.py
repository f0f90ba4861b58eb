"""The process skeleton every Magnitude service shares: the I/O loop (``loop.py``), its memory of accepted
requests (``retries.py``) and the contract its worker threads work to (``workers.py``)."""

from shared.service.loop import Service
from shared.service.workers import Answer, Emitter, Handler, Job

__all__ = ["Answer", "Emitter", "Handler", "Job", "Service"]
