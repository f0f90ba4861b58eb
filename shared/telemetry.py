"""Telemetry: every service reports per-request samples and process figures to the optimizer.

``report(sample)`` only appends to a bounded buffer (never blocks the service
loop). A background thread with its own DEALER socket sends a ``telemetry``
batch about once a second, with the process's RSS, CPU% and queue depth. When
the optimizer is absent (no ipc socket, or the socket's send queue is full) the
batch is dropped and counted: telemetry must never cost a request.

What a sample may hold is declared here too (``RequestSample``,
``GenerationSample``, ``SystemFigures``): the optimizer validates each sample
of a batch on intake with ``validate_sample`` and rejects a bad one alone, so
one non-numeric field never costs the rest of the batch, and only the declared
fields are kept, so a sample's size is bounded whatever a sender puts in it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import psutil
import zmq
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from shared import security
from shared.config import Config, ipc_path
from shared.process import INSTANCE
from shared.protocol import PRIORITIES, encode_request

_BUFFER_SAMPLES = 4096
_BATCH_SAMPLES = 1024
_SEND_HWM = 4  # batches ZeroMQ may hold for a slow optimizer before we drop

#: A finite, non-negative figure (seconds, tokens per second, megabytes, percent, counts).
Figure = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Tokens = Annotated[int, Field(ge=0, le=1 << 30)]


def _priority(value: str) -> str:
    if value not in PRIORITIES:
        raise ValueError(f"must be one of {', '.join(PRIORITIES)}")
    return value


class _Sample(BaseModel):
    # strict: "fast" or True is not a number; extra fields are dropped, not kept
    model_config = ConfigDict(strict=True, extra="ignore")


class RequestSample(_Sample):
    """The generic sample of one finished request (``Telemetry.request_done``)."""

    type: str = Field(min_length=1, max_length=64)
    latency_s: Figure
    queue_wait_s: Figure | None = None
    ok: bool
    code: str | None = Field(None, max_length=64)
    ts: Figure | None = None


class GenerationSample(_Sample):
    """Inference's sample of one finished generation: what the optimizer's policy scores."""

    type: Literal["generation"]
    session: str | None = Field(None, max_length=128)
    ok: bool = True
    settings_id: str | None = Field(None, max_length=64)
    prompt_tokens: Tokens = 0
    cached_tokens: Tokens = 0
    prefill_tokens: Tokens = 0
    completion_tokens: Tokens = 0
    ttft_s: Figure | None = None
    prefill_tps: Figure | None = None
    decode_tps: Figure | None = None
    total_s: Figure | None = None
    stop_reason: str | None = Field(None, max_length=32)
    priority: Annotated[str, AfterValidator(_priority)] | None = None
    pauses: Tokens = 0
    ts: Figure | None = None


class SystemFigures(_Sample):
    """A sender's process figures (the batch's ``system`` map)."""

    rss_mb: Figure | None = None
    cpu_percent: Figure | None = None
    queue_depth: Figure | None = None
    telemetry_dropped: Figure | None = None


def _first_error(err: ValidationError) -> str:
    first = err.errors()[0]
    return f"{'.'.join(map(str, first['loc'])) or 'sample'}: {first['msg']}"


def validate_sample(sample: Any) -> dict[str, Any]:
    """The declared fields of one sample, or ``ValueError`` saying what is wrong with it."""
    if not isinstance(sample, dict):
        raise ValueError(f"a sample must be a map, got {type(sample).__name__}")
    model = GenerationSample if sample.get("type") == "generation" else RequestSample
    try:
        return model.model_validate(sample).model_dump(exclude_none=True)
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None


def validate_system(figures: Any) -> dict[str, Any]:
    """The declared fields of a batch's ``system`` map, or ``ValueError``."""
    try:
        return SystemFigures.model_validate(figures).model_dump(exclude_none=True)
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None


class Telemetry:
    """Buffer and sender of one process's samples; ``NullTelemetry`` where there is nobody to tell."""

    def __init__(self, service: str, endpoint: str, queue_depth: Callable[[], int] = lambda: 0,
                 interval_s: float = 1.0, curve: tuple[Path, str] | None = None):
        self.service, self.endpoint, self.queue_depth, self.interval_s = service, endpoint, queue_depth, interval_s
        self.curve = curve  # (keys_dir, client key name) when the optimizer's endpoint requires CURVE
        self._buffer: deque[dict] = deque(maxlen=_BUFFER_SAMPLES)
        self._lock = threading.Lock()
        self._ctx: zmq.Context = zmq.Context.instance()
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.sent = 0  # samples handed to ZeroMQ
        self.dropped = 0  # samples lost: buffer overflow, or the optimizer absent

    @classmethod
    def for_service(cls, service: str, config: Config, queue_depth: Callable[[], int]) -> "Telemetry":
        endpoint = config.runtime.endpoint("optimizer")
        curve = ((config.runtime.resolved_keys_dir(), config.runtime.client_key)
                 if security.needs_curve(config.runtime, endpoint) else None)
        return cls(service, endpoint, queue_depth, curve=curve)

    def report(self, sample: dict[str, Any]) -> None:
        """Queue one sample (``ts`` is added); cheap and non-blocking."""
        sample.setdefault("ts", time.time())
        with self._lock:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append(sample)

    def request_done(self, request_type: str, latency_s: float, queue_wait_s: float, code: str | None) -> None:
        """The generic sample of one finished request: latency, queue wait, ok (no error code) or the code."""
        self.report({"type": request_type, "latency_s": round(latency_s, 6), "queue_wait_s": round(queue_wait_s, 6),
                     "ok": code is None, "code": code})

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.service}-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _system(self) -> dict[str, Any]:
        return {"rss_mb": round(self._process.memory_info().rss / 2**20, 1),
                "cpu_percent": self._process.cpu_percent(None), "queue_depth": self.queue_depth(),
                "telemetry_dropped": self.dropped}

    def _take(self) -> list[dict]:
        with self._lock:
            batch = [self._buffer.popleft() for _ in range(min(_BATCH_SAMPLES, len(self._buffer)))]
        return batch

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        if self.curve is not None:
            security.apply_curve_client(sock, *self.curve)
        sock.connect(self.endpoint)
        try:
            while not self._stop.wait(self.interval_s):
                while sock.poll(0):  # acks are not needed; keep the receive queue empty
                    sock.recv()
                self.flush(sock)
        finally:
            sock.close(linger=0)

    def flush(self, sock: zmq.Socket) -> None:
        """Send what is buffered as one batch, or drop it when the optimizer is not there."""
        batch = self._take()
        frame = encode_request("telemetry", {"service": self.service, "pid": os.getpid(), "instance": INSTANCE,
                                             "samples": batch, "system": self._system()})
        socket_file = ipc_path(self.endpoint)
        if socket_file is not None and not socket_file.exists():
            self.dropped += len(batch)
            return
        try:
            sock.send(frame, zmq.NOBLOCK)
            self.sent += len(batch)
        except zmq.Again:
            self.dropped += len(batch)


class NullTelemetry(Telemetry):
    """For the optimizer itself (it must not report to itself) and where self-optimization is off."""

    def __init__(self) -> None:
        super().__init__("none", "inproc://none")

    def report(self, sample: dict[str, Any]) -> None:
        pass

    def request_done(self, *args: Any) -> None:
        pass

    def start(self) -> None:
        pass
