"""The inference service against the real Gemma 3 270M model, over its socket."""

import asyncio

import pytest

from shared.client import AsyncClient, Client, GenerateResult, ServiceError
from scripts.bench.prompts import gemma_prompt

pytestmark = pytest.mark.model

HISTORY = [("user", "You control a robot arm. List three household objects it could pick up.")]


@pytest.fixture
def client(inference_service):
    with Client(inference_service.endpoint, timeout_s=120) as c:
        yield c


def test_generate_returns_real_text_streamed(client):
    pieces = list(client.generate_stream(gemma_prompt(HISTORY), max_tokens=24, temperature=0))
    result = pieces[-1]
    text_pieces = pieces[:-1]
    assert isinstance(result, GenerateResult) and len(text_pieces) >= 3
    assert "".join(text_pieces) == result.text and len(result.text.split()) >= 3
    assert result.stats.completion_tokens > 0 and result.stats.ttft_s > 0


def test_session_step_two_reuses_prefix_and_matches_cold_run(client):
    session = "reuse-test"
    # cache_prompt=False: computed from scratch (the first test left this prompt's KV in a slot to share)
    step1 = client.generate(gemma_prompt(HISTORY), session, max_tokens=32, temperature=0, cache_prompt=False)
    assert step1.stats.cached_tokens == 0 and step1.stats.kv_source == "cold"
    history = HISTORY + [("model", step1.text), ("user", "Which of them is the heaviest?")]
    prompt2 = gemma_prompt(history)
    step2 = client.generate(prompt2, session, max_tokens=32, temperature=0)
    s = step2.stats
    assert s.kv_source == "resident" and s.cached_tokens > step1.stats.prompt_tokens // 2
    assert s.prefill_tokens == s.prompt_tokens - s.cached_tokens
    assert s.prefill_tokens < 40  # only the new turn (+ a token or two at the seam), not the history
    cold = client.generate(prompt2, None, max_tokens=32, temperature=0, cache_prompt=False)
    assert cold.stats.cached_tokens == 0 and cold.stats.prefill_tokens == cold.stats.prompt_tokens
    assert cold.text == step2.text


def test_interleaved_sessions_beyond_slots_are_parked_and_restored(client):
    # The test service has 2 slots; three sessions force parking (per-sequence state copy).
    prompts = {name: gemma_prompt([("user", f"Name one fact about the {topic}.")])
               for name, topic in (("ia", "moon"), ("ib", "ocean"), ("ic", "desert"))}
    first = {name: client.generate(p, name, max_tokens=12, temperature=0) for name, p in prompts.items()}
    for name, p in prompts.items():
        follow = p + first[name].text + "<end_of_turn>\n" + gemma_prompt([("user", "And another?")])
        again = client.generate(follow, name, max_tokens=12, temperature=0)
        assert again.stats.kv_source in ("resident", "restored")
        assert again.stats.cached_tokens >= first[name].stats.prompt_tokens
        cold = client.generate(follow, None, max_tokens=12, temperature=0, cache_prompt=False)
        assert again.text == cold.text
    overview = client.request("sessions", session_id="ia")
    assert overview["parked"] >= 1 and overview["session"]["where"] in ("resident", "parked")
    assert "ib" not in str(overview)  # other sessions' ids are not disclosed


def test_stop_sequences_and_max_tokens(client):
    r = client.generate("Count: 1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=40, temperature=0, stop=[" 12"])
    assert r.stats.stop_reason == "stop" and " 12" not in r.text and "11" in r.text
    r = client.generate("Count: 1, 2, 3,", max_tokens=3, temperature=0)
    assert r.stats.stop_reason == "length" and r.stats.completion_tokens == 3


def test_sampling_with_seed_is_reproducible(client):
    args = dict(max_tokens=16, temperature=0.9, seed=7)
    assert client.generate("Once upon a time", **args).text == client.generate("Once upon a time", **args).text


def test_prompt_over_context_is_a_typed_error(client):
    with pytest.raises(ServiceError) as info:
        client.generate("word " * 5000, max_tokens=4)
    assert info.value.code == "bad_request" and "n_ctx" in info.value.message
    assert client.health()["ok"]


def test_large_prompt_travels_through_shm(client):
    from shared import shm
    prompt = "The robot log: " + "status ok. " * 30000  # > inline limit, tokens > n_ctx
    before = set(shm.list_segments())
    with pytest.raises(ServiceError) as info:
        client.generate(prompt, max_tokens=1)
    assert "n_ctx" in info.value.message  # the service read the prompt from the segment
    assert set(shm.list_segments()) <= before  # and released it


def test_prompt_shm_of_another_session_is_refused(client):
    from shared import shm
    handle = shm.put_bytes(b"secret plan of session A", session_id="owner-a")
    with pytest.raises(ServiceError) as info:
        client.request("generate", {"prompt_shm": handle, "max_tokens": 1}, session_id="intruder-b")
    assert info.value.code == "not_found" and "another session" in info.value.message
    assert shm.take_bytes(handle, session_id="owner-a") == b"secret plan of session A"


def test_session_drop(client):
    client.generate("Hello", "drop-me", max_tokens=2)
    assert client.request("session.drop", session_id="drop-me")["dropped"] is True
    assert client.generate("Hello", "drop-me", max_tokens=2).stats.kv_source == "cold"


def test_async_client_streams(inference_service):
    async def run():
        c = AsyncClient(inference_service.endpoint, timeout_s=120)
        pieces = [p async for p in c.generate_stream("The capital of France is", max_tokens=8, temperature=0)]
        health = await c.health()
        c.close()
        return pieces, health
    pieces, health = asyncio.run(run())
    assert isinstance(pieces[-1], GenerateResult) and "".join(pieces[:-1]) == pieces[-1].text
    assert health["ok"] and health["model"]


def test_concurrent_sessions_are_batched_and_match_sequential_output(inference_service, client):
    import threading
    prompts = {f"batch-{i}": gemma_prompt([("user", f"Write a sentence about {topic}.")])
               for i, topic in enumerate(("rivers", "robots"))}
    sequential = {s: client.generate(p, None, max_tokens=24, temperature=0) for s, p in prompts.items()}
    assert all(r.stats.peak_batch == 1 for r in sequential.values())  # alone: one generation per step
    results = {}

    def run(session, prompt):
        with Client(inference_service.endpoint, timeout_s=120) as c:
            results[session] = c.generate(prompt, session, max_tokens=24, temperature=0)

    threads = [threading.Thread(target=run, args=item) for item in prompts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each request says how many generations shared a decode step with it: both ran in the same steps.
    assert all(r.stats.peak_batch == 2 for r in results.values()), {s: r.stats for s, r in results.items()}
    assert {s: r.text for s, r in results.items()} == {s: r.text for s, r in sequential.items()}
