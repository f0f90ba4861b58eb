"""The HTTP gateway against the real stack, called the way agent frameworks call it: the official openai SDK.

One stack serves the module: inference (the Gemma base model as ``default`` for
raw completions, the catalog's test chat model by its catalog name), embedding,
optimizer, tools (for /v1/responses, whose own tests are tests/services/gateway/test_gateway_agent.py),
and two gateway processes in front of them. ``open`` is the default gateway
(loopback, no key). ``strict`` needs an API key, admits one request at a time,
gives up after 1.5 s, takes bodies up to 4 KiB, and has no embedding service
behind it: with it every error status of the API shows up for a real reason.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import jsonschema
import numpy as np
import openai
import pytest
from openai import OpenAI

from services.gateway.keys import create_key, read_local_key
from shared import catalog
from shared.client import Client
from shared.config import DEFAULT_EMBEDDING_MODEL_FILE, parse_config
from tests.conftest import (CHAT_MODEL_PATH, REPO, REPORT, ServiceProcess, make_config, require_model, wait_for,
                            write_config)

pytestmark = pytest.mark.model

EMBEDDING_MODEL = Path(DEFAULT_EMBEDDING_MODEL_FILE).stem
BASE_MODEL = "default"  # the engine's model_path model: a base model, for raw completions
CHAT_MODEL = catalog.TEST_CHAT_MODEL  # the smallest catalog model whose template renders tools
STRICT_TIMEOUT_S = 1.5
#: What every schemathesis run against the gateway uses (docs/gateway.md has the longer run): text as UTF-8
#: (JSON can carry lone surrogates, which are no text); every check but positive_data_acceptance, which expects
#: each schema-valid body to succeed, while a valid-looking chat can still be refused for what no schema can say
#: (a model without a chat template, a prompt over the context, roles out of order): 400, as OpenAI answers.
SCHEMATHESIS_ARGS = ["--generation-codec", "utf-8", "--exclude-checks", "positive_data_acceptance",
                     "--generation-database", "none", "--output-sanitize", "false"]


def stack_config(home: Path):
    """Agent runs (schemathesis starts some) are kept short: two steps of 32 tokens."""
    require_model(CHAT_MODEL_PATH)
    data = make_config(home, n_ctx=1024, models={CHAT_MODEL: str(CHAT_MODEL_PATH)}).model_dump(mode="json")
    return parse_config({**data, "agent": {**data["agent"], "max_iterations": 2, "max_step_tokens": 32}})


class Gateway:
    def __init__(self, home: Path, overrides: dict, key: str | None = None):
        data = stack_config(home).model_dump(mode="json")
        for section, values in overrides.items():
            data[section] = {**data[section], **values}
        self.config = parse_config(data)
        self.process = ServiceProcess("gateway", write_config(home, self.config), self.config).start()
        with Client(self.process.endpoint, timeout_s=5) as c:
            self.url = c.health()["url"]
        self.key = key or read_local_key(self.config)  # the open one's: the key its first start made

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"}

    def sdk(self, key: str | None = None, **kwargs) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0,
                      timeout=kwargs.pop("timeout", 120), **kwargs)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    require_model()
    home = Path(os.path.realpath(tmp_path_factory.mktemp("gw", numbered=True)))
    config = stack_config(home)
    path = write_config(home, config)
    services = [ServiceProcess(name, path, config).start() for name in ("inference", "embedding", "optimizer", "tools")]
    keys_file = home / "api_keys"
    key = create_key(keys_file, "robot")
    gateways = []
    try:
        gateways.append(Gateway(home, {}))
        gateways.append(Gateway(home, {
            "gateway": {"api_keys_file": str(keys_file), "max_concurrent": 1, "request_timeout_s": STRICT_TIMEOUT_S,
                        "max_body_bytes": 4096},
            "runtime": {"endpoints": {"gateway": f"ipc://{home}/strict.sock",
                                      "embedding": f"ipc://{home}/no-embedding.sock"}}}, key=key))
        yield {"open": gateways[0], "strict": gateways[1], "config": config, "home": home, "keys_file": keys_file}
    finally:
        for svc in [g.process for g in gateways] + services[::-1]:
            svc.stop()


def inference_idle(stack) -> None:
    """Wait out generations an earlier test left running (a client that gave up does not stop them)."""
    def idle() -> bool:
        with Client.for_service("inference", stack["config"], timeout_s=5) as c:
            health = c.health()
        return health["running"] == 0 and health["queue_depth"] == 0
    wait_for(idle, 60, "inference idle")


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return stack["open"].sdk()


# --- models, completions, sessions, embeddings, feedback, health, metrics -------------------------
def test_models_list_the_chat_and_embedding_models(client):
    models = {m.id: m for m in client.models.list()}
    assert BASE_MODEL in models and EMBEDDING_MODEL in models
    assert models[BASE_MODEL].model_extra["kind"] == "generation" and models[EMBEDDING_MODEL].model_extra["kind"] == "embedding"
    assert client.models.retrieve(EMBEDDING_MODEL).id == EMBEDDING_MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_completion_streamed_and_whole_are_the_same_text_with_usage(client):
    args = dict(model=BASE_MODEL, prompt="The robot drove to the", max_tokens=12, temperature=0)
    whole = client.completions.create(**args)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 12
    chunks = list(client.completions.create(**args, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # OpenAI's form on request: one more chunk without choices that carries the usage
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == whole.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_session_reuse_over_http_reports_cached_tokens(client):
    prompt = "Robot log.\n08:00 Charged the battery.\n08:15 Vacuumed the hall.\n08:30"
    session = {"X-Session-Id": f"run-{time.monotonic_ns()}"}
    first = client.completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                      extra_headers=session)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt += first.choices[0].text + "\n09:00"
    second = client.completions.create(model=BASE_MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_headers=session)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and second.model_extra["timings"]["cache_n"] == cached
    assert second.model_extra["timings"]["prompt_n"] == second.usage.prompt_tokens - cached
    REPORT.append(f"gateway session reuse: step 2 reused {cached} of {second.usage.prompt_tokens} prompt tokens")


def test_embeddings_float_and_base64(client):
    reply = client.embeddings.create(model=EMBEDDING_MODEL, input=["where are the keys?", "the keys are in the bowl"])
    vectors = np.array([d.embedding for d in reply.data], dtype=np.float32)
    assert vectors.shape == (2, 384) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-3)
    assert reply.usage.prompt_tokens > 0 and reply.model == EMBEDDING_MODEL
    # The encodings are compared on the same request shape: the same text alone in its batch, so the same
    # computation; the two encodings must carry the same float32 values.
    alone = client.embeddings.create(model=EMBEDDING_MODEL, input="where are the keys?").data[0].embedding
    b64 = client.embeddings.create(model=EMBEDDING_MODEL, input="where are the keys?", encoding_format="base64")
    assert np.allclose(np.frombuffer(base64.b64decode(b64.data[0].embedding), "<f4"), alone, atol=1e-6)
    # Across batch shapes llama.cpp's kernels are not bit-identical (a fresh clone measured about 2e-5 between
    # the text alone and in a pair), so there only the direction is compared.
    assert float(np.dot(np.asarray(alone, np.float32), vectors[0])) > 0.9999
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="text-embedding-3-small", input="x")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=EMBEDDING_MODEL, input="x", dimensions=128)


def test_feedback_reaches_the_optimizer(stack):
    url = stack["open"].url
    receipt = httpx.post(f"{url}/v1/feedback", json={"session_id": "run-1", "success": False,
                                                     "error_reason": "picked the wrong room"},
                         headers=stack["open"].headers()).json()
    assert receipt["durable"] is True
    with Client.for_service("optimizer", stack["config"], timeout_s=5) as c:
        stats = c.request("feedback.stats")
    assert stats["failed"] >= 1 and any(e["reason"] == "picked the wrong room" for e in stats["top_errors"])


def test_health_and_metrics(stack):
    url = stack["open"].url
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json() == {
        "status": "ok", "services": {"inference": True, "embedding": True, "optimizer": True}}
    text = httpx.get(f"{url}/metrics", headers=stack["open"].headers()).text
    assert 'magnitude_http_requests_total{method="POST",route="/v1/completions",status="200"}' in text
    assert 'magnitude_requests_total{type="generate"}' in text
    strict = httpx.get(f"{stack['strict'].url}/health").json()  # open without a key; no embedding behind it
    assert strict["services"]["embedding"] is False and strict["status"] == "ok"


# --- errors: each status, for a real reason ------------------------------------------------------
def test_400_bad_request(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=BASE_MODEL, prompt="hi", max_tokens=4, temperature=3)
    assert err.value.body["param"] == "temperature" and err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="n_ctx"):  # refused by inference itself
        client.completions.create(model=BASE_MODEL, prompt="word " * 2000, max_tokens=4)
    # the agent's step policy reads a history as a conversation: a tool reply that names no call is the client's
    # error, not the gateway's (schemathesis found it as a 500)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default:agent", messages=[
            {"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], max_tokens=4)
    assert err.value.body["param"] == "messages"


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=4)
    assert err.value.body["code"] == "model_not_found"


def test_401_without_or_with_a_wrong_key(stack):
    strict = stack["strict"]
    with pytest.raises(openai.AuthenticationError):
        strict.sdk(key="mag-wrong").models.list()
    response = httpx.get(f"{strict.url}/v1/models")
    assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert BASE_MODEL in {m.id for m in strict.sdk().models.list()}


def test_keys_added_and_revoked_without_a_restart(stack):
    strict, keys_file = stack["strict"], stack["keys_file"]
    new = create_key(keys_file, "arm")
    assert strict.sdk(key=new).models.list().data
    from services.gateway.keys import revoke_key
    assert revoke_key(keys_file, "arm")
    with pytest.raises(openai.AuthenticationError):
        strict.sdk(key=new).models.list()
    assert strict.sdk().models.list().data  # the other key still works


def test_413_body_too_large(stack):
    with pytest.raises(openai.APIStatusError) as err:
        stack["strict"].sdk().completions.create(model=BASE_MODEL, prompt="x" * 5000, max_tokens=4)
    assert err.value.status_code == 413 and err.value.body["code"] == "too_large"


def test_429_busy_with_retry_after(stack):
    strict = stack["strict"]
    inference_idle(stack)
    stream = strict.sdk().completions.create(model=BASE_MODEL, prompt="Once upon a time", max_tokens=200,
                                             temperature=0, stream=True)
    try:
        next(iter(stream))  # the one admission slot is taken while this stream runs
        with pytest.raises(openai.RateLimitError) as err:
            strict.sdk().completions.create(model=BASE_MODEL, prompt="hi", max_tokens=4)
        assert err.value.response.headers["retry-after"] == "1"
    finally:
        stream.close()


def test_503_service_not_running(stack):
    with pytest.raises(openai.InternalServerError) as err:
        stack["strict"].sdk().embeddings.create(model=EMBEDDING_MODEL, input="x")
    assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
    assert err.value.body["code"] == "unavailable"


def test_504_timeout(stack):
    inference_idle(stack)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        stack["strict"].sdk().completions.create(model=BASE_MODEL, prompt="Once upon a time", max_tokens=400,
                                                 temperature=0)
    assert err.value.status_code == 504 and err.value.body["code"] == "timeout"
    assert time.monotonic() - started < STRICT_TIMEOUT_S + 2


def test_stream_cut_by_the_deadline_ends_with_an_error_event(stack):
    inference_idle(stack)
    stream = stack["strict"].sdk().completions.create(model=BASE_MODEL, prompt="Once upon a time",
                                                      max_tokens=400, temperature=0, stream=True)
    with pytest.raises(openai.APIError, match="gateway.request_timeout_s"):
        for _ in stream:
            pass


# --- chat ---------------------------------------------------------------------------------------------
ROBOT_TOOLS = [{"type": "function", "function": {
    "name": "move_to", "description": "Drive the robot to a room.",
    "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["kitchen", "hall", "bedroom"]}},
                   "required": ["room"]}}}]


def test_chat_whole_and_streamed_are_the_same_reply(client):
    args = dict(model=CHAT_MODEL, messages=[{"role": "system", "content": "You answer in one short sentence."},
                                            {"role": "user", "content": "Which room is the fridge in?"}],
                max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**args)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content and not message.tool_calls
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(**args, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_developer_role_and_text_parts_read_as_system_and_text(client):
    plain = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Color of the sky?"}]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
             {"role": "user", "content": [{"type": "text", "text": "Color of "}, {"type": "text", "text": "the sky?"}]}]
    replies = [client.chat.completions.create(model=CHAT_MODEL, messages=m, max_tokens=8, temperature=0)
               for m in (plain, parts)]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens


def test_chat_session_reuse_over_http(client):
    """A second request with the same X-Session-Id reports cached tokens > 0."""
    session = {"X-Session-Id": f"agent-{time.monotonic_ns()}"}
    messages = [{"role": "system", "content": "You plan the steps of a household robot, one short step per reply."},
                {"role": "user", "content": "Task: bring a glass of water. First step?"}]
    first = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=24, temperature=0,
                                           extra_headers=session)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "Done: the robot is in the kitchen. Next step?"}]
    second = client.chat.completions.create(model=CHAT_MODEL, messages=messages, max_tokens=24, temperature=0,
                                            extra_headers=session)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and second.model_extra["timings"]["cache_n"] == cached
    REPORT.append(f"gateway chat session: step 2 reused {cached} of {second.usage.prompt_tokens} prompt tokens")


def test_tool_round_trip_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Go to the kitchen."}]
    reply = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=ROBOT_TOOLS, max_tokens=64,
                                           temperature=0)
    assert reply.choices[0].finish_reason == "tool_calls"
    [call] = reply.choices[0].message.tool_calls
    assert call.type == "function" and call.function.name == "move_to" and call.id
    assert json.loads(call.function.arguments) == {"room": "kitchen"}
    # streamed: the call arrives as one tool_calls delta, never as text
    chunks = list(client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=ROBOT_TOOLS,
                                                 max_tokens=64, temperature=0, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        (0, "move_to", {"room": "kitchen"})]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].usage.completion_tokens > 0
    # the tool's result goes back; the model answers it
    messages += [reply.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "arrived in the kitchen"}]
    answer = client.chat.completions.create(model=CHAT_MODEL, messages=messages, tools=ROBOT_TOOLS, tool_choice="none",
                                            max_tokens=32, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "move_to"}}])
def test_tool_choice_forces_a_call(client, choice):
    reply = client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Hello there!"}],
                                           tools=ROBOT_TOOLS, tool_choice=choice, max_tokens=48, temperature=0)
    call = reply.choices[0].message.tool_calls[0]  # more may follow; the last may be cut off by max_tokens
    assert call.function.name == "move_to" and json.loads(call.function.arguments)["room"] in ("kitchen", "hall",
                                                                                               "bedroom")
    for later in reply.choices[0].message.tool_calls[1:]:  # a call cut off is shown, and says why
        assert later.function.name == "move_to" or later.model_extra["error"]


def test_json_schema_output_validates(client):
    schema = {"type": "object", "properties": {"room": {"type": "string", "maxLength": 40},
                                               "chairs": {"type": "integer", "minimum": 0}},
              "required": ["room", "chairs"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "The kitchen has 3 chairs. Describe it as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "room", "schema": schema, "strict": True}},
        max_tokens=64, temperature=0)
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    loose = client.chat.completions.create(
        model=CHAT_MODEL, messages=[{"role": "user", "content": "Give the kitchen's chair count as JSON."}],
        response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    assert isinstance(json.loads(loose.choices[0].message.content), dict)


def test_chat_refusals_are_400(client):
    with pytest.raises(openai.BadRequestError, match="template"):  # the base model has no chat template
        client.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError):  # tool_choice names no tool
        client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}],
                                       tools=ROBOT_TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "hi"}], n=2)
    assert err.value.body["param"] == "n"


def test_the_docs_snippet_runs_as_written(stack):
    """docs/gateway.md's Python block, run against this stack: only its URL is this gateway's. README.md shows
    the same block."""
    text = (REPO / "docs" / "gateway.md").read_text()
    snippet = text.split("<!-- snippet:", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "http://localhost:8000/v1" in snippet and f"```python\n{snippet}```" in (REPO / "README.md").read_text()
    snippet = snippet.replace("http://localhost:8000/v1", f"{stack['open'].url}/v1")
    out = subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, MAGNITUDE_CONFIG=str(stack["open"].process.config_path)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "read_thermometer {'room': 'kitchen'}" and lines[1].strip(), out.stdout  # a call, words
    reused = re.search(r"(\d+) of \d+ prompt tokens were reused from step 1", out.stdout)
    assert reused and int(reused[1]) > 0, out.stdout
    REPORT.append("gateway docs snippet printed: " + " | ".join(out.stdout.strip().splitlines()))


# --- the OpenAPI document, checked by schemathesis ----------------------------------------------------
def test_schemathesis_finds_no_server_error_and_no_schema_violation(stack):
    """A short run in the suite: a fixed seed, a few examples per operation (docs/gateway.md: the long one)."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SCHEMATHESIS_HOOKS="tests.gateway_st_hooks",
               GATEWAY_ST_MODELS=f"{BASE_MODEL},{CHAT_MODEL}", GATEWAY_ST_EMBEDDING_MODEL=EMBEDDING_MODEL)
    out = subprocess.run([sys.executable, "-m", "schemathesis.cli", "--config-file", str(REPO / "tests/schemathesis.toml"),
                          "run", f"{stack['open'].url}/openapi.json",
                          "--max-examples", "8", "--seed", "1", "-H", f"Authorization: Bearer {stack['open'].key}",
                          *SCHEMATHESIS_ARGS],
                         capture_output=True, text=True, timeout=600, env=env, cwd=stack["home"])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]
    summary = [line.strip() for line in out.stdout.splitlines() if "generated" in line or " passed" in line]
    REPORT.append("gateway schemathesis (short): " + "; ".join(summary[-3:]))
