"""Hot and rebuilding engine settings, speculative decoding and model slots on the real model."""

import pytest

from shared.client import Client, ServiceError
from tests.conftest import MODEL_PATH, ServiceProcess, make_config, require_model, write_config

pytestmark = pytest.mark.model

#: Output that repeats what the prompt shows: prompt-lookup drafting should guess much of it.
REPETITIVE = "".join(f'{{"step": {i}, "tool": "calculator", "args": {{"expression": "{i} * 7"}}}}\n'
                     for i in range(1, 7)) + '{"step": 7, "tool": "calculator", "args": {"expression": "'


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    require_model()
    home = tmp_path_factory.mktemp("tune", numbered=True)
    config = make_config(home, n_ctx=1024, models={"fast": str(MODEL_PATH)}, max_models=2,
                         draft_model_path=str(MODEL_PATH))  # its own draft model: the mechanics, not a speed-up
    svc = ServiceProcess("inference", write_config(home, config), config).start()
    yield svc
    svc.stop()


@pytest.fixture
def client(service):
    with Client(service.endpoint, timeout_s=120) as c:
        yield c


def configure(client, **settings):
    return client.request("engine.configure", {"settings": settings})


def test_hot_settings_apply_without_a_rebuild(client):
    before = client.health()
    reply = configure(client, n_threads=1, prefill_chunk_size=64)
    assert reply["reloaded"] is False and reply["settings"]["n_threads"] == 1
    assert reply["settings"]["prefill_chunk_size"] == 64 and reply["settings_id"] != before["settings_id"]
    assert client.health()["settings_id"] == reply["settings_id"]
    assert client.generate("The robot moved to the", max_tokens=8, temperature=0).stats.completion_tokens > 0
    configure(client, **{k: before["settings"][k] for k in ("n_threads", "prefill_chunk_size")})


def test_rebuilding_settings_keep_the_service_and_answer_the_same_text(client):
    prompt = "Kitchen inventory: two cups, one kettle, and"
    step = client.generate(prompt, "rebuild", max_tokens=12, temperature=0)
    reply = configure(client, max_batch_size=256, prefill_chunk_size=128)
    assert reply["reloaded"] is True and reply["settings"]["max_batch_size"] == 256
    again = client.generate(prompt, "rebuild", max_tokens=12, temperature=0)
    assert again.text == step.text and again.stats.kv_source == "cold"  # a rebuild forgets cached KV
    assert configure(client, max_batch_size=512, prefill_chunk_size=256)["reloaded"] is True


@pytest.mark.parametrize("settings, says", [
    ({"n_ctx": 512}, "not tunable"),
    ({"kv_cache_type": "fp8"}, "kv_cache_type"),
    ({"prefill_chunk_size": 4096}, "max_batch_size"),
    ({"n_threads": 10_000}, "CPUs"),
    ({"spec_draft_tokens": -1}, "spec_draft_tokens"),
    ({"spec_drafter": "oracle"}, "spec_drafter"),
])
def test_bad_settings_are_refused_and_change_nothing(client, settings, says):
    before = client.health()["settings_id"]
    with pytest.raises(ServiceError) as err:
        configure(client, **settings)
    assert err.value.code == "bad_request" and says in err.value.message
    assert client.health()["settings_id"] == before


# The grammar leaves the numbers and the tool's name free: what a grammar forces is decoded as forced tokens
# whatever the setting, so only free text is left for the drafts to guess.
GRAMMAR = ('root ::= [0-9]+ " * " [0-9]+ "\\"}}\\n{\\"step\\": " [0-9]+ ", \\"tool\\": \\"" [a-z]+ "\\", '
           '\\"args\\": {\\"expression\\": \\"" [0-9]+ " * " [0-9]+ "\\"}}"')


def test_speculative_drafting_gives_the_same_text_with_fewer_decode_steps(client):
    """Drafts by lookup: how many a step verifies is chosen from this box's measured step costs, so this asks
    for long repetitive text, where acceptance is high enough that they pay on any CPU measured so far. (With
    a grammar only single free tokens are left to draft, a choice that turns on the box's timing: the draft
    model's test covers grammars, as its drafter proposes at the set length whatever the costs.)"""
    plain = client.generate(REPETITIVE, max_tokens=60, temperature=0)
    configure(client, spec_draft_tokens=8)
    try:
        drafted = client.generate(REPETITIVE, max_tokens=60, temperature=0)
    finally:
        configure(client, spec_draft_tokens=0)
    assert drafted.text == plain.text
    assert drafted.stats.completion_tokens == plain.stats.completion_tokens
    assert plain.stats.draft_tokens == 0
    assert drafted.stats.accepted_tokens > 0, drafted.stats


@pytest.mark.parametrize("grammar", [None, GRAMMAR])
def test_a_draft_model_proposes_and_the_target_keeps_its_text(client, grammar):
    plain = client.generate(REPETITIVE, max_tokens=40, temperature=0, grammar=grammar)
    configure(client, spec_draft_tokens=4, spec_drafter="model")
    try:
        drafted = client.generate(REPETITIVE, max_tokens=40, temperature=0, grammar=grammar)
        follow_up = client.generate(REPETITIVE + drafted.text, max_tokens=8, temperature=0)  # the mirror catches up
    finally:
        configure(client, spec_draft_tokens=0, spec_drafter="lookup")
    assert drafted.text == plain.text
    # The draft model is the target model here, so its greedy drafts are (nearly) always right.
    assert drafted.stats.accepted_tokens >= drafted.stats.draft_tokens * 0.8 > 0, drafted.stats
    assert follow_up.stats.completion_tokens > 0


def test_requests_name_a_resident_model_and_switching_costs_no_reload(client):
    first = client.generate("The hallway light is", max_tokens=6, temperature=0, model="fast")
    assert first.stats.model == "fast"
    again = client.generate("The hallway light is", max_tokens=6, temperature=0, model="fast")
    default = client.generate("The hallway light is", max_tokens=6, temperature=0)
    assert again.stats.model_load_ms == 0 and default.stats.model_load_ms == 0
    assert default.stats.model == "default" and again.text == default.text  # the same GGUF twice
    listing = client.request("model.list")
    assert {m["name"] for m in listing["models"] if m["resident"]} == {"default", "fast"}
    switched = client.request("model.switch", {"name": "fast"})
    assert switched["default"] == "fast" and switched["switch_ms"] == 0
    client.request("model.switch", {"name": "default"})


def test_unknown_model_is_not_found_and_unload_then_reload(client):
    with pytest.raises(ServiceError) as err:
        client.generate("x", max_tokens=2, model="nope")
    assert err.value.code == "not_found"
    assert client.request("model.unload", {"name": "fast"})["unloaded"] is True
    back = client.generate("The door is", max_tokens=4, temperature=0, model="fast")
    assert back.stats.model_load_ms > 0 and client.health()["ok"]
