"""Hardening of the gateway against callers that would fill its memory or lock others out."""

import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx2 as httpx
import pytest

from services.agent.loop import Conversation
from services.gateway.errors import ApiError
from services.gateway.keys import create_key
from services.gateway.responses import Runs
from services.gateway.stored import Stored, StoredResponse
from shared.client import Client
from shared.config import parse_config
from tests.conftest import ServiceProcess, make_config, write_config


class _Run:
    """A parked run as Runs sees it: an owner, the caller's calls it waits for, and end() dropping its session."""

    def __init__(self, owner):
        self.owner, self.ended = owner, False
        self.waiting = [SimpleNamespace(call_id=f"call_{id(self)}", name="thermometer")]

    def end(self):
        self.ended = True


def _runs(total: int, per_key: int) -> Runs:
    settings = SimpleNamespace(agent_wait_s=600.0, max_parked_runs=total, max_parked_runs_per_key=per_key)
    return Runs(SimpleNamespace(config=SimpleNamespace(gateway=settings), log=None))


def test_parked_runs_are_capped_per_key_and_in_all():
    async def scenario():
        runs = _runs(total=3, per_key=2)
        runs.park("r1", _Run("a"))
        runs.park("r2", _Run("a"))
        over = _Run("a")
        with pytest.raises(ApiError) as err:
            runs.park("r3", over)
        assert err.value.status == 429 and over.ended
        runs.park("r4", _Run("b"))
        with pytest.raises(ApiError) as err:
            runs.park("r5", _Run("c"))
        assert err.value.status == 429
    asyncio.run(scenario())


def _stored(response_id: str, owner: str, session: str) -> StoredResponse:
    response = SimpleNamespace(id=response_id, model="default")
    return StoredResponse(owner, response, Conversation("hi"), session, [], None)


def test_kept_responses_are_a_bounded_cache_that_drops_a_session_with_its_last_response():
    """Over a cap the oldest response goes (never a 429); a session's KV is dropped only with the response that
    could go on in it, and a turn that goes on from an older response does not take the session over."""
    async def scenario():
        dropped = []
        settings = SimpleNamespace(agent_wait_s=600.0, max_stored_responses=3, max_stored_responses_per_key=2)
        stored = Stored(settings, lambda owner, session: dropped.append((owner, session)))
        stored.keep(_stored("r1", "a", "s1"))
        stored.keep(_stored("r2", "a", "s2"))
        stored.keep(_stored("r3", "a", "s3"))  # a's third: its oldest, r1, goes, and with it session s1
        assert dropped == [("a", "s1")]
        with pytest.raises(ApiError) as err:
            stored.get("r1", "a")
        assert err.value.status == 404
        with pytest.raises(ApiError):
            stored.get("r2", "b")  # another key's
        entry, warm = stored.go_on("r2", "a")  # r2 is s2's latest: the next turn takes the session over
        assert warm and entry.session_id == "s2"
        stored.keep(_stored("r4", "a", "s2"))  # that turn's response: now s2's latest (r2 goes: a's cap)
        assert stored.go_on("r4", "a")[1]
        stored.keep(_stored("r5", "a", "s2"))  # r3 goes (a's cap), and session s3 with it
        assert not stored.go_on("r4", "a")[1]  # r4 is no longer s2's latest: a branch from it gets its own session
        assert dropped == [("a", "s1"), ("a", "s3")]
        stored.delete("r5", "a")
        assert dropped[-1] == ("a", "s2")
    asyncio.run(scenario())


# --- finding 1: stalled requests lock no keyed caller out --------------------------------------------------
def _gateway(home: Path, inference_home: Path, **gateway_config) -> tuple[ServiceProcess, str, dict[str, str]]:
    """A gateway process in front of the suite's inference service (its endpoints are ``inference_home``'s),
    with two API keys; its URL and the keys' Authorization headers by name."""
    home.mkdir()
    keys_file = home / "api_keys"
    keys = {name: {"Authorization": f"Bearer {create_key(keys_file, name)}"} for name in ("robot", "mallory")}
    base = make_config(inference_home).model_dump(mode="json")
    config = parse_config({**base, "gateway": {**base["gateway"], "api_keys_file": str(keys_file), **gateway_config},
                           "runtime": {**base["runtime"], "endpoints": {"gateway": f"ipc://{home}/gw.sock"}}})
    process = ServiceProcess("gateway", write_config(home, config), config).start()
    with Client(process.endpoint, timeout_s=5) as c:
        return process, c.health()["url"], keys


def _stall(url: str, headers: dict[str, str], path: str = "/v1/completions") -> socket.socket:
    """A request that declares a 100 kB body, sends 8 bytes of it and stalls."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    sock = socket.create_connection((host, port))
    lines = [f"POST {path} HTTP/1.1", "Host: localhost", "Content-Type: application/json",
             "Content-Length: 100000", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + b'{"model"')
    return sock


def _answer(sock: socket.socket, timeout_s: float) -> tuple[bytes, bool]:
    """What the server sent on ``sock`` within ``timeout_s``, and whether it closed the connection by then."""
    deadline = time.monotonic() + timeout_s
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except TimeoutError:
            break
        if not chunk:
            return data, True
        data += chunk
    return data, False


def _status(sock: socket.socket, timeout_s: float) -> bytes:
    """The status line of the answer on ``sock`` (b"" if none came within ``timeout_s``)."""
    return _answer(sock, timeout_s)[0].split(b"\r\n")[0]


def _complete(url: str, headers: dict[str, str]) -> tuple[int, float]:
    started = time.monotonic()
    answer = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                        json={"model": "default", "prompt": "The robot", "max_tokens": 4, "temperature": 0})
    return answer.status_code, time.monotonic() - started


@pytest.mark.model
def test_stalled_bodies_without_a_key_take_no_slot(inference_service, run_home, tmp_path):
    """Finding 1: 32 unauthenticated POSTs that stall mid-body took every slot of gateway.max_concurrent (32),
    and a keyed caller's completion and /health got 429 while they stayed open."""
    process, url, keys = _gateway(tmp_path / "gw", run_home)
    stalled = []
    try:
        status, alone_s = _complete(url, keys["robot"])
        assert status == 200
        stalled = [_stall(url, {}) for _ in range(32)]
        time.sleep(0.5)  # every stalled request has reached the gateway
        status, seconds = _complete(url, keys["robot"])
        assert status == 200 and seconds < max(2.0, 3 * alone_s), (status, seconds, alone_s)
        assert httpx.get(f"{url}/health").status_code == 200
        assert all(b" 401 " in _status(sock, 2) for sock in stalled)  # refused at once, their bodies unread
    finally:
        for sock in stalled:
            sock.close()
        process.stop()


@pytest.mark.model
def test_one_key_holds_its_share_of_slots_and_stalled_bodies_time_out(inference_service, run_home, tmp_path):
    """Finding 1, with a key: one caller's stalled uploads hold at most gateway.max_concurrent_per_key slots,
    another key and /health are still served, and each stalled body is answered 408 after
    gateway.body_timeout_s."""
    process, url, keys = _gateway(tmp_path / "gw", run_home, max_concurrent=8, max_concurrent_per_key=4,
                                  body_timeout_s=3)
    stalled = []
    try:
        stalled = [_stall(url, keys["mallory"]) for _ in range(4)]
        time.sleep(0.5)
        over = _stall(url, keys["mallory"])  # mallory's fifth: over its share
        assert b" 429 " in _status(over, 2)
        assert _complete(url, keys["robot"])[0] == 200
        assert httpx.get(f"{url}/health").status_code == 200
        answers = [_answer(sock, 10) for sock in stalled]  # each closed, after its 408
        assert all(closed and b" 408 " in data.split(b"\r\n")[0] and b"body_timeout_s" in data
                   for data, closed in answers), answers[0]
        assert _complete(url, keys["mallory"])[0] == 200  # its slots are back
    finally:
        for sock in stalled:
            sock.close()
        process.stop()


def test_headers_sent_slowly_are_cut_off(run_home, tmp_path):
    """Finding 1, slowloris: a connection that sends its headers a line now and then was held open forever."""
    process, url, keys = _gateway(tmp_path / "gw", run_home, header_timeout_s=1)
    try:
        host, port = urlsplit(url).hostname, urlsplit(url).port
        with socket.create_connection((host, port)) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")
            started = time.monotonic()
            assert _answer(slow, 10) == (b"", True) and time.monotonic() - started < 5
        with socket.create_connection((host, port)) as quick:  # headers in time: answered as ever
            quick.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            assert _status(quick, 10).startswith(b"HTTP/1.1 ")
    finally:
        process.stop()
