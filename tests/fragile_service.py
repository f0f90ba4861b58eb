"""A stand-in service whose only worker thread dies on ``tool.list``: for the worker-liveness tests.

Run: ``python -m tests.fragile_service --config F``.
"""

from __future__ import annotations

from services.runner import run_service
from shared.service import Service, Sink


class WorkerDied(Exception):
    pass


class FragileService(Service):
    name = "tools"

    def __init__(self, config, endpoint=None):
        super().__init__(config, endpoint)
        self.handle("tool.list", lambda req, emit: {"tools": []})

    def work_loop(self, sink: Sink) -> None:
        while True:
            job = self.workers.next_job(0.2, sink)
            if job is not None and job.request.type == "tool.list":
                raise WorkerDied("injected: the worker loop itself failed")
            if job is None and self.idle_and_stopping():
                return


if __name__ == "__main__":
    run_service(FragileService, "tools")
