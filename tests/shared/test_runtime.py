"""The runtime apart from its transports, in process: workers answer through a sink (a list here, no socket),
and the runtime drains a transport's accepted work before it closes it."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from shared.protocol import ErrorCode, ProtocolError, Request, decode_reply
from shared.service import Job, Runtime, Service, Transport
from tests.conftest import make_config


class ListSink:
    """Keeps what a worker answers: (kind, reply, error code)."""

    def __init__(self) -> None:
        self.replies: list[tuple[str, object, str | None]] = []

    def reply(self, job: Job, kind: str, payload: bytes, code: str | None = None) -> None:
        self.replies.append((kind, decode_reply(payload), code))


def _job(msg_type: str, cancelled: bool = False) -> Job:
    return Job([b"peer"], Request("r1", msg_type, None, {}), time.monotonic(), is_cancelled=lambda: cancelled)


@pytest.fixture
def service(tmp_path):
    svc = Service(make_config(tmp_path), endpoint=f"ipc://{tmp_path}/unused.sock")
    yield svc
    svc.metrics.close()


def test_a_worker_answers_its_handler_and_its_events_through_the_sink(service):
    def tools(req, emit):
        emit.event({"step": 1})
        return {"tools": []}

    service.handle("tool.list", tools)
    sink = ListSink()
    service.run_job(_job("tool.list"), sink)
    (event_kind, event, _), (kind, reply, code) = sink.replies
    assert (event_kind, event.body, kind, reply.body, code) == ("event", {"step": 1}, "ok", {"tools": []}, None)


def test_a_handler_error_costs_one_typed_error_reply(service):
    def broken(req, emit):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "no such tool")

    service.handle("tool.list", broken)
    sink = ListSink()
    service.run_job(_job("tool.list"), sink)
    [(kind, reply, code)] = sink.replies
    assert kind == "error" and code == reply.error_code == ErrorCode.BAD_REQUEST


def test_a_job_cancelled_while_queued_is_answered_cancelled_instead_of_running(service):
    service.handle("tool.list", lambda req, emit: pytest.fail("a cancelled job ran"))
    service.workers.queue.put(_job("tool.list", cancelled=True))
    sink = ListSink()
    assert service.workers.next_job(0, sink) is None
    [(kind, reply, code)] = sink.replies
    assert kind == "error" and code == ErrorCode.CANCELLED
    assert service.workers.running == 1  # until the transport forwards that final reply
    service.workers.finished()


class CountdownTransport(Transport):
    """Holds accepted work for a few polls after the stop; records the order the runtime calls it in, and runs
    a loop on a watched thread until the stop."""

    def __init__(self, runtime: Runtime, unanswered_polls: int):
        self.runtime, self.left, self.calls = runtime, unanswered_polls, []
        self.stopped = threading.Event()

    def open(self):
        self.calls.append("open")
        return {"endpoint": "memory"}

    def loops(self):
        return [self.stopped.wait]

    def poll(self, timeout_s):
        if not self.runtime.stopping:
            assert self.runtime.health()["workers"] == 1  # the loop's thread is watched like a worker
            self.runtime.stop()  # as SIGTERM would
        elif self.left:
            self.left -= 1
        self.calls.append("poll")

    def stop(self):
        self.calls.append("stop")
        self.stopped.set()

    def unanswered(self):
        return self.left > 0

    def close(self):
        self.calls.append(f"close with {self.left} unanswered")


def run_until_stopped(runtime: Runtime, transport: Transport) -> None:
    """``runtime.run()`` over ``transport`` (which stops it), the test process's signal handlers kept."""
    runtime.transports.append(transport)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        runtime.run()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_stopped_runtime_drains_its_transports_then_closes_them(tmp_path):
    runtime = Runtime(make_config(tmp_path))
    transport = CountdownTransport(runtime, unanswered_polls=3)
    run_until_stopped(runtime, transport)
    # It polls until drained (and on while its loop's thread ends), then closes the transport.
    assert transport.calls[:6] == ["open", "stop", "poll", "poll", "poll", "poll"]
    assert set(transport.calls[6:-1]) <= {"poll"} and transport.calls[-1] == "close with 0 unanswered"


class SavingTransport(CountdownTransport):
    """Its watched loop, once stopped, works a while longer (as inference's scheduler saves the sessions)."""

    def __init__(self, runtime: Runtime):
        super().__init__(runtime, unanswered_polls=0)
        self.saving = threading.Event()

    def loops(self):
        return [self.save_after_stop]

    def save_after_stop(self):
        self.stopped.wait()
        self.saving.set()
        time.sleep(0.5)
        self.calls.append("saved")

    def poll(self, timeout_s):
        super().poll(timeout_s)
        if self.saving.is_set() and "saved" not in self.calls:
            self.calls.append("polled while saving: stopping" if self.runtime.health()["stopping"] else "?")
        time.sleep(timeout_s)


def test_a_stopping_runtime_answers_until_its_threads_have_ended(tmp_path):
    """Health is answered (``stopping``) while a watched thread still works after the drain, and the transport
    closes after it: a supervisor sees a service stopping, not a closed socket beside a live process."""
    runtime = Runtime(make_config(tmp_path))
    transport = SavingTransport(runtime)
    run_until_stopped(runtime, transport)
    calls = transport.calls
    assert "polled while saving: stopping" in calls and "?" not in calls
    assert calls.index("saved") < calls.index("close with 0 unanswered") == len(calls) - 1
