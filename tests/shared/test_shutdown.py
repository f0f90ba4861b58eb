"""SIGTERM drains: a request in flight when the service is told to stop still gets its answer."""

import signal
import time

import pytest

from shared.client import Client
from shared import shm
from shared.protocol import encode_request
from tests.conftest import ServiceProcess, make_config, require_model, write_config

pytestmark = pytest.mark.model


def test_sigterm_finishes_in_flight_request_then_exits(tmp_path_factory):
    require_model()
    home = tmp_path_factory.mktemp("sd")
    config = make_config(home)
    svc = ServiceProcess("inference", write_config(home, config), config).start()
    try:
        with Client(svc.endpoint, timeout_s=120) as client:
            client.send_raw(encode_request("generate", {"prompt": "Tell me about robots.", "max_tokens": 48},
                                                 request_id="inflight"))
            # Wait until the worker has picked it up, then ask the service to stop.
            while client.health()["running"] == 0:
                pass
            svc.proc.send_signal(signal.SIGTERM)
            reply = client.recv_reply("inflight")
            assert reply.kind == "ok" and reply.body["stats"]["completion_tokens"] > 0
        assert svc.proc.wait(30) == 0
        assert not [s for s in shm.list_segments() if s.startswith(f"mag_{svc.proc.pid}_")]
    finally:
        svc.stop()


def test_sigterm_during_the_very_first_prefill_still_answers(tmp_path_factory):
    """The job counts as running from the moment it leaves the queue, so the drain waits for its reply even
    while its prompt is still being read (before any token exists)."""
    require_model()
    home = tmp_path_factory.mktemp("sd1")
    config = make_config(home)
    svc = ServiceProcess("inference", write_config(home, config), config).start()
    prompt = "Robot maintenance log. " + " ".join(f"Day {i}: wheels checked, battery at {i % 50 + 50}%." for i in range(120))
    try:
        with Client(svc.endpoint, timeout_s=120) as client:
            sent = time.monotonic()
            client.send_raw(encode_request("generate", {"prompt": prompt, "max_tokens": 4}, request_id="first"))
            while client.health()["running"] == 0:
                pass
            svc.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic() - sent
            reply = client.recv_reply("first")
            assert reply.kind == "ok" and reply.body["stats"]["completion_tokens"] > 0
            assert reply.body["stats"]["prompt_tokens"] > 1000 and reply.body["stats"]["ttft_s"] > signalled  # stopped mid-prefill
        assert svc.proc.wait(30) == 0
    finally:
        svc.stop()
