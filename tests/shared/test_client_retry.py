"""The client fails fast when its service goes away mid-request, and retries with the same request id.

A scripted ROUTER in a thread plays the service: it answers each request with the next scripted
frames, and "crashes" (closes its socket, so the client's connection drops) where told to.
"""

import asyncio
import threading
import time

import msgpack
import pytest
import zmq

from shared.client import AsyncClient, Call, Client, Restart, Retry, ServiceError
from shared.protocol import encode_error, encode_reply

CRASH = "crash"  # script step: close the socket (the client sees a disconnect), bind again a moment later


class ScriptedService:
    """Answers request N with script[N]: a list of (kind, body) frames, or CRASH after some frames."""

    def __init__(self, endpoint: str, script: list, restart_after_s: float = 0.3):
        self.endpoint, self.script, self.restart_after_s = endpoint, list(script), restart_after_s
        self.requests: list[dict] = []  # every request received, in order
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.ready.wait(5)

    def _bind(self) -> zmq.Socket:
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.endpoint)
        return sock

    def _run(self) -> None:
        sock = self._bind()
        self.ready.set()
        for step in self.script:
            if not sock.poll(10_000):
                break
            *header, payload = sock.recv_multipart()
            request = msgpack.unpackb(payload)
            self.requests.append(request)
            for frame in step:
                if frame == CRASH:
                    sock.close(linger=0)
                    time.sleep(self.restart_after_s)
                    sock = self._bind()
                    break
                kind, body = frame
                payload = (encode_error(request["id"], body["code"], "scripted") if kind == "error"
                           else encode_reply(request["id"], kind, body))
                sock.send_multipart(header + [payload])
        sock.close(linger=0)

    def join(self) -> None:
        self.thread.join(10)


@pytest.fixture
def endpoint(tmp_path):
    return f"ipc://{tmp_path}/svc.sock"


def test_backoff_doubles_up_to_the_cap_and_gives_up_at_the_deadline():
    seen = []
    now = [0.0]
    attempts = Call("ipc:///nowhere", "health", None, None, None, timeout_s=1,
                    retry=Retry(deadline_s=5, first_backoff_s=0.1, max_backoff_s=0.3, on_retry=seen.append),
                    clock=lambda: now[0])
    delays = [attempts.restart_after(ServiceError("busy", "full")).delay_s for _ in range(4)]
    assert delays == [0.1, 0.2, 0.3, 0.3] and [r.attempt for r in seen] == [2, 3, 4, 5]
    with pytest.raises(ServiceError) as info:
        attempts.restart_after(ServiceError("bad_request", "no"))
    assert info.value.code == "bad_request"  # never retried
    now[0] = 10.0  # the deadline has passed
    with pytest.raises(ServiceError) as info:
        attempts.restart_after(ServiceError("unavailable", "down"))
    assert info.value.code == "unavailable" and "gave up after 5 attempt(s)" in info.value.message


def test_service_dying_mid_request_fails_fast_not_at_timeout(endpoint):
    service = ScriptedService(endpoint, [[("event", {"text": "par"}), CRASH]])
    with Client(endpoint, timeout_s=30) as client:
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as info:
            list(client.generate_stream("hi"))
        assert info.value.code == "unavailable" and "went away" in info.value.message
        assert time.monotonic() - t0 < 5  # not the 30 s timeout
    service.join()


def test_restart_between_requests_is_invisible(endpoint):
    service = ScriptedService(endpoint, [[("ok", {"n": 1}), CRASH], [("ok", {"n": 2})]])
    with Client(endpoint, timeout_s=10) as client:
        assert client.request("health") == {"n": 1}
        time.sleep(1.0)  # the service restarts while the client is idle; ZeroMQ reconnects
        assert client.request("health") == {"n": 2}
    service.join()


def test_retry_resends_the_same_id_on_busy_but_never_on_bad_request(endpoint):
    service = ScriptedService(endpoint, [[("error", {"code": "busy"})], [("ok", {"done": True})],
                                         [("error", {"code": "bad_request"})]])
    notices = []
    retry = Retry(deadline_s=10, first_backoff_s=0.05, on_retry=notices.append)
    with Client(endpoint, timeout_s=10) as client:
        assert client.request("health", retry=retry) == {"done": True}
        with pytest.raises(ServiceError) as info:
            client.request("health", retry=retry)
    assert info.value.code == "bad_request"
    ids = [r["id"] for r in service.requests]
    assert len(ids) == 3 and ids[0] == ids[1] != ids[2]
    assert [(n.attempt, n.code) for n in notices] == [(2, "busy")]
    service.join()


def test_stream_restarts_after_a_crash_and_says_so(endpoint):
    service = ScriptedService(endpoint, [[("event", {"text": "half "}), CRASH],
                                         [("event", {"text": "whole"}), ("ok", {"text": "whole", "stats": {}})]])
    with Client(endpoint, timeout_s=10) as client:
        pieces = list(client.generate_stream("plan", "s1", retry=Retry(deadline_s=10, first_backoff_s=0.05)))
    assert pieces[0] == "half " and isinstance(pieces[1], Restart) and pieces[1].code == "unavailable"
    assert pieces[2] == "whole" and pieces[3].text == "whole"
    assert service.requests[0]["id"] == service.requests[1]["id"]
    assert service.requests[1]["session"] == "s1"
    service.join()


def test_service_staying_down_past_the_deadline_is_a_clear_error(endpoint):
    with Client(endpoint, timeout_s=10) as client:
        t0 = time.monotonic()
        with pytest.raises(ServiceError) as info:
            client.request("health", retry=Retry(deadline_s=1, first_backoff_s=0.1))
    assert info.value.code == "unavailable" and "gave up after" in info.value.message
    assert time.monotonic() - t0 < 3


def test_async_stream_restarts_after_a_crash(endpoint):
    service = ScriptedService(endpoint, [[("event", {"text": "half "}), CRASH],
                                         [("event", {"text": "whole"}), ("ok", {"text": "whole", "stats": {}})]])

    async def run():
        client = AsyncClient(endpoint, timeout_s=10)
        try:
            return [p async for p in client.generate_stream("plan", retry=Retry(deadline_s=10, first_backoff_s=0.05))]
        finally:
            client.close()
    pieces = asyncio.run(run())
    assert pieces[0] == "half " and isinstance(pieces[1], Restart) and pieces[2:3] == ["whole"]
    assert pieces[3].text == "whole" and service.requests[0]["id"] == service.requests[1]["id"]
    service.join()


def test_async_dying_mid_request_fails_fast(endpoint):
    service = ScriptedService(endpoint, [[CRASH]])

    async def run():
        client = AsyncClient(endpoint, timeout_s=30)
        try:
            await client.health()
        finally:
            client.close()
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as info:
        asyncio.run(run())
    assert info.value.code == "unavailable" and time.monotonic() - t0 < 5
    service.join()


def test_bad_retry_settings_are_refused():
    with pytest.raises(ValueError, match="deadline_s"):
        Retry(deadline_s=0)
    with pytest.raises(ValueError, match="first_backoff_s"):
        Retry(first_backoff_s=5, max_backoff_s=1)


def test_call_reads_frames_and_events_without_io():
    """The client core decides what frames and monitor events mean; no socket is involved."""
    now = [0.0]
    call = Call("tcp://127.0.0.1:1", "generate", {"prompt": "hi"}, "s", "req-1", timeout_s=7,
                retry=Retry(deadline_s=2), clock=lambda: now[0])
    assert msgpack.unpackb(call.frame)["id"] == "req-1" and call.wait_s() == 2  # the deadline bounds the first frame
    assert call.on_frame(encode_reply("someone-else", "ok", {})) is None  # stale: skipped
    assert call.on_frame(encode_reply("req-1", "event", {"text": "a"})).body == {"text": "a"}
    assert call.wait_s() == 7 and not call.done  # answering: each frame gets the full timeout
    call.on_events([zmq.EVENT_DISCONNECTED], in_flight=False)  # between requests: nothing
    with pytest.raises(ServiceError, match="went away") as info:
        call.on_events([zmq.EVENT_DISCONNECTED])
    assert info.value.code == "unavailable"
    with pytest.raises(ServiceError) as info:
        call.on_events([zmq.EVENT_HANDSHAKE_FAILED_AUTH], in_flight=False)
    assert info.value.code == "unauthorized"
    with pytest.raises(ServiceError) as info:
        call.on_frame(encode_error("req-1", "busy", "queue full"))
    assert info.value.code == "busy" and call.restart_after(info.value).attempt == 2
    assert call.on_frame(encode_reply("req-1", "ok", {"text": "done"})).final and call.done
    call.expect_frame()
    assert call.poll_ms() == 7000
    now[0] = 7.5
    assert call.poll_ms() is None and call.timed_out().code == "timeout" and "7s" in call.timed_out().message
