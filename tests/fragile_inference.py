"""The real inference service, except that its scheduler loop dies on a ``generate`` whose prompt is
``"<die>"``: for the inference worker-liveness test (``tests/services/inference/test_inference_liveness.py``).

Run: ``python -m tests.fragile_inference --config F``.
"""

from __future__ import annotations

from services.inference.service import InferenceService
from services.runner import run_service

DIE = "<die>"


class WorkerDied(BaseException):
    """Not an Exception: nothing on the request path catches it, as with a bug in the loop itself."""


class FragileInference(InferenceService):
    def serve(self, job, sink):
        if getattr(job.request.message, "prompt", None) == DIE:
            return self.handover.put(job)  # to the scheduler's thread as it is: run_job below fails there
        super().serve(job, sink)

    def run_job(self, job, sink):
        if getattr(job.request.message, "prompt", None) == DIE:
            raise WorkerDied("injected: the scheduler loop itself failed")
        super().run_job(job, sink)


if __name__ == "__main__":
    run_service(FragileInference, "inference")
