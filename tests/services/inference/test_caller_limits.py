"""Who a generation counts against (issue 34, finding 9): inference's ``runtime.max_generations_per_client``
counted connections, and the gateway borrows a connection per HTTP request, so 20 of 20 concurrent keyless
chats were admitted where a key got 16 and four 429s. Now the gateway names every caller to inference (the
``owner`` field: the key's name, or one name for all keyless callers), and only a peer that may send
privileged messages may name one, so an ordinary client cannot speak for another or dodge its own limit."""

from __future__ import annotations

import threading
import uuid

import httpx2 as httpx
import pytest

from shared.client import Client, ServiceError
from shared.config import parse_config
from tests.conftest import CHAT_MODEL_PATH, ServiceProcess, make_config, require_model, wait_for, write_config
from tests.shared.test_curve import free_port
from tests.shared.test_session_logs import logged_sessions

pytestmark = pytest.mark.model

LIMIT = 3
CALLERS = 8


def test_keyless_chats_through_the_gateway_share_one_callers_limit(tmp_path):
    """Eight keyless chats at once: the limit's three stream, the five others are answered 429 by inference's
    per-client limit (not by a full queue or the gateway's own admission, both set wide here)."""
    require_model(CHAT_MODEL_PATH)
    base = make_config(tmp_path, model_path=str(CHAT_MODEL_PATH), n_ctx=1024).model_dump(mode="json")
    config = parse_config({**base, "gateway": {**base["gateway"], "allow_keyless_loopback": True},
                           "runtime": {**base["runtime"], "queue_size": 32, "max_generations_per_client": LIMIT}})
    path = write_config(tmp_path, config)
    services = []
    try:
        services = [ServiceProcess(name, path, config).start() for name in ("inference", "gateway")]
        with Client(services[1].endpoint, timeout_s=5) as c:
            url = c.health()["url"] + "/v1/chat/completions"
        story = {"model": "default", "max_tokens": 400, "temperature": 0, "stream": True,
                 "messages": [{"role": "user", "content": "Write a very long story about a robot that cooks."}]}
        answers: list[tuple[int, str]] = []
        all_answered = threading.Barrier(CALLERS)

        def chat() -> None:
            with httpx.Client(timeout=120) as http, http.stream("POST", url, json=story) as answer:
                answers.append((answer.status_code, "" if answer.status_code == 200 else answer.read().decode()))
                all_answered.wait(120)  # every stream stays open until each caller has its answer
        callers = [threading.Thread(target=chat) for _ in range(CALLERS)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(180)
        statuses = sorted(status for status, _ in answers)
        assert statuses == [200] * LIMIT + [429] * (CALLERS - LIMIT), answers
        assert all("max_generations_per_client" in text for status, text in answers if status == 429), answers

        with Client(services[0].endpoint, timeout_s=10) as inference:  # the closed streams were cancelled
            wait_for(lambda: inference.health()["generations_in_flight"] == 0, 30, "nothing in flight")
        session = f"robot-{uuid.uuid4().hex}"
        short = {**story, "stream": False, "max_tokens": 2}
        assert httpx.post(url, json=short, headers={"X-Session-Id": session}, timeout=120).status_code == 200
        assert session not in services[0].log.read_text()  # session ids are never logged, their refs are
        assert {len(ref) for ref in logged_sessions(services[0].log, "chat") - {None}} == {12}
    finally:
        for svc in reversed(services):
            svc.stop()


def test_only_an_authenticated_peer_may_name_an_owner(tmp_path):
    """On plain loopback tcp, which any local account reaches, a request naming an owner is refused: with it
    one could reach a gateway tenant's KV and take its share, or dodge its own limit under a fresh name each
    time. Without one it is served, counted by its connection."""
    base = make_config(tmp_path).model_dump(mode="json")
    config = parse_config({**base, "runtime": {**base["runtime"],
                                               "endpoints": {"inference": f"tcp://127.0.0.1:{free_port()}"}}})
    svc = ServiceProcess("inference", write_config(tmp_path, config), config).start()
    try:
        with Client(svc.endpoint, timeout_s=60) as client:
            for msg_type, body in (("generate", {"prompt": "The robot", "max_tokens": 1}), ("sessions", {})):
                with pytest.raises(ServiceError) as err:
                    client.request(msg_type, {**body, "owner": "alice"}, "alice/notes")
                assert err.value.code == "unauthorized" and "owner" in err.value.message, err.value
            assert client.generate("The robot", max_tokens=1).stats.completion_tokens == 1
    finally:
        svc.stop()
