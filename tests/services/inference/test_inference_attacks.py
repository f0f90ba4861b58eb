"""Requests against inference (issue 16; issue 23, findings 1 and 5): a grammar that crashed llama.cpp,
a SIGTERM during the first prefill that dropped its reply, cached tokens that told one tenant about
another's prompt, corrupt or alternating models, a grammar flattened on the decode thread."""

from __future__ import annotations

import os
import signal
import uuid

import pytest

from shared.client import Client, ServiceError
from shared.config import parse_config
from shared.protocol import encode_request
from tests.conftest import (MODEL_PATH, ServiceProcess, gaps_while, make_config, require_model, running_inference,
                            write_config)

pytestmark = pytest.mark.security


@pytest.mark.model
def test_a_grammar_bomb_is_a_typed_error_and_inference_stays_up(inference_service):
    def bomb(levels: int) -> str:
        return "root ::= " + "(" * levels + '"a"' + ")" * levels

    with Client(inference_service.endpoint, timeout_s=60) as client:
        pid = client.health()["pid"]
        # The 200 KB bomb, and one within the size limit that llama.cpp's parser still cannot survive.
        for grammar, why in ((bomb(100_000), "bytes"), (bomb(30_000), "nested 30000 deep")):
            with pytest.raises(ServiceError) as info:
                client.generate("Say a", max_tokens=2, grammar=grammar)
            assert info.value.code == "bad_request" and why in info.value.message, info.value
        assert client.generate("Say a", max_tokens=2, grammar='root ::= "a"').text == "a"
        health = client.health()
        assert health["ok"] and health["pid"] == pid


@pytest.mark.model
def test_sigterm_during_the_first_prefill_still_answers(tmp_path):
    require_model()
    config = make_config(tmp_path, n_ctx=4096, max_batch_size=2048, prefill_chunk_size=2048)
    svc = ServiceProcess("inference", write_config(tmp_path, config), config).start()
    try:
        prompt = "The robot checked the hallway, the kitchen and the garage. " * 220  # ~2,800 tokens
        with Client(svc.endpoint, timeout_s=120) as client:
            client.send_raw(encode_request("generate", {"prompt": prompt, "max_tokens": 4}, request_id="first"))
            # Health on the same socket is read after the generate: queue_depth 0 means the worker took it.
            while True:
                client.send_raw(encode_request("health", request_id="probe"))
                reply = client.recv_reply()
                if reply.id == "probe" and reply.body["queue_depth"] == 0:
                    break
            svc.proc.send_signal(signal.SIGTERM)
            reply = client.recv_reply("first")
            assert reply.kind == "ok" and reply.body["stats"]["completion_tokens"] >= 1
        assert svc.proc.wait(30) == 0
    finally:
        svc.stop()


def test_cached_tokens_tell_no_tenant_about_another_tenants_prompt(tmp_path):
    """Alice's prompt holds a secret. Mallory, with her own key and a fresh session id per guess, sends the
    same prefix followed by a guess at the next digit, max_tokens 1, and reads cached_tokens: before, the
    right digit scored one token more than every wrong one. Now KV is shared only within an owner, so every
    guess scores the same (and the owner herself still reuses her prefix)."""
    from openai import OpenAI
    from services.gateway.keys import create_key
    config = make_config(tmp_path, session_slots=4)
    keys_file = tmp_path / "api_keys"
    keys = {name: create_key(keys_file, name) for name in ("alice", "mallory")}
    config = parse_config({**config.model_dump(mode="json"),
                           "gateway": {**config.gateway.model_dump(mode="json"), "api_keys_file": str(keys_file)}})
    path = write_config(tmp_path, config)
    services = [ServiceProcess(name, path, config).start() for name in ("inference", "gateway")]
    try:
        with Client(services[1].endpoint, timeout_s=5) as c:
            url = c.health()["url"] + "/v1"
        sdk = {name: OpenAI(base_url=url, api_key=key, max_retries=0) for name, key in keys.items()}
        note = "Household notes. The plumber comes on Friday. The code of the garden safe is 4"
        sdk["alice"].completions.create(model="default", prompt=note + "817.", max_tokens=1, temperature=0,
                                        extra_headers={"X-Session-Id": "alice-notes"})

        def probe(guess: str) -> int:
            reply = sdk["mallory"].completions.create(model="default", prompt=note + guess, max_tokens=1,
                                                      temperature=0,
                                                      extra_headers={"X-Session-Id": uuid.uuid4().hex})
            return reply.usage.prompt_tokens_details.cached_tokens

        probe("x")  # her own KV of the prefix, so every guess below starts equal
        scores = {digit: probe(digit) for digit in "0123456789"}
        assert len(set(scores.values())) == 1, scores
        mine = sdk["alice"].completions.create(model="default", prompt=note + "817. And", max_tokens=1,
                                               temperature=0, extra_headers={"X-Session-Id": "alice-notes"})
        assert mine.usage.prompt_tokens_details.cached_tokens > scores["8"]
    finally:
        for svc in reversed(services):
            svc.stop()


def test_a_corrupt_model_file_fails_its_request_and_loads_are_bounded(tmp_path):
    """A request naming a corrupt GGUF killed the scheduler's worker on main; it now fails that request alone.
    And a caller alternating between models that are not resident cannot make the box load and evict them in
    a loop: requests bring in one model per engine.model_load_interval_s."""
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(4096))
    with running_inference(tmp_path, max_models=1, models={"broken": str(corrupt), "other": str(MODEL_PATH)}) as svc:
        with Client(svc.endpoint, timeout_s=60) as client:
            pid = client.health()["pid"]
            with pytest.raises(ServiceError) as err:
                client.generate("Hello", max_tokens=2, model="broken")
            assert err.value.code == "bad_request" and "cannot be loaded" in err.value.message
            assert client.generate("Hello", max_tokens=2, model="other").stats.model == "other"
            with pytest.raises(ServiceError) as err:  # back to the default at once: that would be a second load
                client.generate("Hello", max_tokens=2)
            assert err.value.code == "busy" and "model_load_interval_s" in err.value.message
            health = client.health()
            assert health["ok"] and health["pid"] == pid and health["model_loads"] == 2


def test_a_deep_grammar_is_flattened_off_the_decode_thread(inference_service):
    """A 128 KB grammar nested 999 deep cost 1.5 s of flattening on the decode thread: another stream stopped
    for that long. It is prepared on a preparing worker now; the stream keeps its pace."""
    grammar = "root ::= " + "(" * 999 + '"a"' + ")" * 999 + " " + " ".join(["[a-z]"] * 20000)
    grammar = grammar[:127 * 1024]
    done = {}
    with Client(inference_service.endpoint, timeout_s=120) as steady, \
            Client(inference_service.endpoint, timeout_s=120) as hostile:
        stream = steady.generate_stream("Count from one to one hundred: one, two,", max_tokens=120, temperature=0,
                                        cache_prompt=False)
        gaps = gaps_while(stream, 5, lambda: done.update(
            reply=_outcome(lambda: hostile.generate("a", max_tokens=2, grammar=grammar))))
    assert "reply" in done and gaps and max(gaps) < 0.5, (done, max(gaps, default=None))


def _outcome(call):
    """The call's result, or the typed error it answered (a refusal is a bounded answer too)."""
    try:
        return call()
    except ServiceError as err:
        return err
