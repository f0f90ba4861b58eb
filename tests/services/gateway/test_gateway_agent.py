"""POST /v1/responses: Magnitude's agent loop over HTTP, driven with a plain HTTP client against the real stack.

The stack: inference (the default agent model: the smaller test chat model answered
the calculator task with its call written out as text), the tool service with the
calculator, and two gateways: ``open`` (loopback, no key) and ``strict`` (API
keys; a waiting run is dropped after ``WAIT_S``).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from magnitude.agent import Agent
from services.gateway.keys import create_key, read_local_key
from shared import catalog
from shared.client import Client
from shared.config import parse_config
from tests.conftest import (REPORT, ServiceProcess, make_config, require_model, stream_event_classes, wait_for,
                            write_config)

pytestmark = pytest.mark.model

WAIT_S = 3.0
MODEL_PATH = catalog.get(catalog.DEFAULT_AGENT_MODEL).path()
THERMOMETER = {"type": "function", "name": "read_thermometer",
               "description": "The temperature in a room, in degrees Celsius.",
               "parameters": {"type": "object", "properties": {"room": {"type": "string", "enum": ["kitchen", "hall"]}},
                              "required": ["room"]}}


def agent_config(home: Path, endpoint: str | None = None, **gateway):
    """The stack's config; ``endpoint``: a second gateway's own socket, ``gateway``: its settings."""
    require_model(MODEL_PATH)
    base = make_config(home, model_path=str(MODEL_PATH), n_ctx=2048).model_dump(mode="json")
    if endpoint:
        base["runtime"]["endpoints"] = {**base["runtime"]["endpoints"], "gateway": endpoint}
    return parse_config({**base, "agent": {"tools": [{"name": "calculator"}], "recall_k": 0, "max_iterations": 4,
                                           "max_step_tokens": 96},
                         "gateway": {**base["gateway"], **gateway}})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    home = Path(os.path.realpath(tmp_path_factory.mktemp("gwa", numbered=True)))
    config = agent_config(home)
    path = write_config(home, config)
    services = [ServiceProcess(name, path, config).start() for name in ("inference", "tools")]
    keys_file = home / "api_keys"
    keys = {"robot": create_key(keys_file, "robot"), "arm": create_key(keys_file, "arm")}
    strict_config = agent_config(home, f"ipc://{home}/strict.sock", api_keys_file=str(keys_file), agent_wait_s=WAIT_S)
    gateways = [ServiceProcess("gateway", path, config).start(),
                ServiceProcess("gateway", write_config(home, strict_config), strict_config).start()]
    try:
        urls = []
        for gateway in gateways:
            with Client(gateway.endpoint, timeout_s=5) as c:
                urls.append(c.health()["url"])
        FIRST_START_KEYS[urls[0]] = read_local_key(config)  # the open gateway's: its first start made it
        yield {"config": config, "open": urls[0], "strict": urls[1], "keys": keys, "gateways": gateways}
    finally:
        for svc in gateways + services[::-1]:
            svc.stop()


#: A gateway's URL -> the key its first start made (keys_dir/local.key), used when a call names no key.
FIRST_START_KEYS: dict[str, str] = {}


def auth(url: str, key: str | None = None) -> dict:
    key = key or FIRST_START_KEYS.get(url)
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = auth(url, key)
    return httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=300)


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    """Every SSE event of a streamed run, as (event name, data)."""
    out, name = [], None
    with httpx.stream("POST", f"{url}/v1/responses", json={**body, "stream": True}, headers=auth(url),
                      timeout=300) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                out.append((name, json.loads(line.split(":", 1)[1])))
    return out


def answer(response: dict) -> str:
    messages = [item for item in response["output"] if item["type"] == "message"]
    return messages[-1]["content"][0]["text"]


def busy(stack) -> tuple[int, int]:
    """Generations running in inference, and HTTP requests in flight at the open gateway."""
    with Client.for_service("inference", stack["config"], timeout_s=5) as c:
        inference = c.health()["generations_in_flight"]
    with Client(stack["gateways"][0].endpoint, timeout_s=5) as c:
        return inference, c.health()["running"]


def cancelled(stack) -> float:
    """Generations inference ended because their client cancelled them."""
    with Client.for_service("inference", stack["config"], timeout_s=5) as c:
        text = c.request("metrics")["text"]
    found = re.search(r'^magnitude_errors_total\{code="cancelled"\} (\S+)$', text, re.M)
    return float(found[1]) if found else 0.0


def test_a_configured_tool_task_streams_each_step_and_matches_the_in_process_agent(stack):
    goal = "What is 4738 * 2961?"
    got = events(stack["open"], {"input": goal})
    names = [name for name, _ in got]
    assert names[0] == "response.created" and names[-1] == "response.completed", names
    assert all(data["type"] == name for name, data in got)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    items = [data["item"] for name, data in got if name == "response.output_item.done"]
    final = got[-1][1]["response"]
    assert final["status"] == "completed" and final["output"] == items
    calls = [item for item in items if item["type"] == "tool_call"]
    assert calls and calls[0]["name"] == "calculator" and calls[0]["output"] == "14029218", items
    assert "14029218" in answer(final).replace(",", "")

    # The same loop in process, on the same services: the same calls and the same answer.
    agent = Agent(stack["config"])
    try:
        trace = agent.run(goal)
    finally:
        agent.close()
    assert [(c.name, c.arguments, c.output) for s in trace.steps for c in s.calls] == [
        (c["name"], c["arguments"], c["output"]) for c in calls]
    assert trace.answer == answer(final)
    metrics = httpx.get(f"{stack['open']}/metrics", headers=auth(stack["open"])).text
    assert 'magnitude_http_requests_total{method="POST",route="/v1/responses",status="200"}' in metrics


def test_a_caller_tool_comes_back_as_a_function_call_and_the_run_resumes_on_its_output(stack):
    url = stack["open"]
    first = post(url, {"input": "How warm is it in the kitchen right now?", "tools": [THERMOMETER]})
    assert first.status_code == 200, first.text
    waiting = first.json()
    assert waiting["status"] == "requires_action", waiting
    call = waiting["output"][-1]
    assert call["type"] == "function_call" and call["name"] == "read_thermometer", call
    assert json.loads(call["arguments"]) == {"room": "kitchen"}
    # A waiting run holds no generation and no request (the count ends just after the response's last byte).
    wait_for(lambda: busy(stack) == (0, 0), 5, "nothing held while the run waits")

    wrong = post(url, {"previous_response_id": waiting["id"],
                       "input": [{"type": "function_call_output", "call_id": "call_other", "output": "?"}]})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "input"  # and the run still waits

    resume = {"previous_response_id": waiting["id"],
              "input": [{"type": "function_call_output", "call_id": call["call_id"], "output": '{"celsius": 21.5}'}]}
    done = post(url, resume)
    assert done.status_code == 200, done.text
    final = done.json()
    assert final["status"] == "completed" and final["previous_response_id"] == waiting["id"], final
    assert final["id"] != waiting["id"] and "21.5" in answer(final), final
    again = post(url, resume)  # the run is no longer waiting under that id
    assert again.status_code == 404 and again.json()["error"]["code"] == "response_not_found"


def test_a_900k_character_tool_output_finishes_the_run(stack):
    """Issue 34, finding 5: resuming a run with a 900k-character function_call_output made the agent send a 1.8 MB
    memory write, which retrieval refused without its request id, and the HTTP request hung (280+ s). The output is
    cut to agent.sandbox.max_output_bytes, as a configured tool's is, and the run finishes."""
    url = stack["open"]
    waiting = post(url, {"input": "How warm is it in the kitchen right now?", "tools": [THERMOMETER]}).json()
    assert waiting["status"] == "requires_action", waiting
    output = '{"celsius": 21.5, "log": "' + "sensor ok; " * 82_000 + '"}'
    assert len(output) > 900_000
    done = post(url, {"previous_response_id": waiting["id"], "input": [
        {"type": "function_call_output", "call_id": waiting["output"][-1]["call_id"], "output": output}]})
    assert done.status_code == 200, done.text
    assert done.json()["status"] in ("completed", "incomplete"), done.json()


def test_a_client_that_re_sends_the_whole_history_resumes_the_waiting_run(stack):
    """The OpenAI Agents SDK runs statelessly: its next request is every item so far, no previous_response_id."""
    url = stack["open"]
    goal = {"role": "user", "content": "How warm is it in the kitchen right now?"}
    waiting = post(url, {"input": [goal], "tools": [THERMOMETER]}).json()
    assert waiting["status"] == "requires_action", waiting
    call = waiting["output"][-1]
    history = [goal, *({k: item[k] for k in ("type", "call_id", "name", "arguments")} for item in waiting["output"]
                       if item["type"] == "function_call"),
               {"type": "function_call_output", "call_id": call["call_id"], "output": '{"celsius": 21.5}'}]
    done = post(url, {"input": history, "tools": [THERMOMETER]})
    assert done.status_code == 200, done.text
    final = done.json()
    assert final["status"] == "completed" and final["previous_response_id"] == waiting["id"], final
    assert "21.5" in answer(final), final
    # That call was answered, so no run waits for it: the history is a conversation of its own, answered afresh
    # from the output it holds (as a stateless server answers a re-sent history).
    again = post(url, {"input": history, "tools": [THERMOMETER]})
    assert again.status_code == 200, again.text
    fresh = again.json()
    assert fresh["status"] == "completed" and fresh["previous_response_id"] is None, fresh
    assert "21.5" in answer(fresh), fresh


def test_a_caller_tool_shadows_the_configured_tool_of_its_name(stack):
    mine = {"type": "function", "name": "calculator", "description": "Evaluates an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                           "required": ["expression"]}}
    reply = post(stack["open"], {"input": "What is 4738 * 2961? Use the calculator.", "tools": [mine]})
    assert reply.status_code == 200, reply.text
    waiting = reply.json()
    assert waiting["status"] == "requires_action", waiting  # the caller's calculator, not the gateway's
    assert waiting["output"][-1]["name"] == "calculator"
    assert not [item for item in waiting["output"] if item["type"] == "tool_call"], waiting


def test_bad_input_is_a_clear_4xx(stack):
    url = stack["open"]
    cases = [
        ({}, 400, "input"),
        ({"input": ""}, 400, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}]}, 400, "input"),
        ({"input": "hi", "previous_response_id": "resp_none"}, 404, "previous_response_id"),
        ({"input": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]}, 400, "input"),
        ({"input": "hi", "tools": [THERMOMETER, THERMOMETER]}, 400, "tools"),
        ({"input": "hi", "tools": [dict(THERMOMETER, name="bad name")]}, 400, "tools.0.name"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "1"}],
          "previous_response_id": "resp_none"}, 404, "previous_response_id"),
        ({"input": "hi", "model": "gpt-4o"}, 404, None),
    ]
    for body, status, param in cases:
        reply = post(url, body)
        assert reply.status_code == status, (body, reply.text)
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}, reply.text
        if param is not None:  # a union's member may follow the field's name: input.constrained-str
            assert reply.json()["error"]["param"].startswith(param), (body, reply.text)
    assert post(url, {"input": "hi", "model": "gpt-4o"}).json()["error"]["code"] == "model_not_found"
    assert post(url, {"input": "hi", "model": "gpt-4o", "stream": True}).status_code == 404  # before any event


def test_a_waiting_run_is_its_callers_alone_and_expires(stack):
    url, keys = stack["strict"], stack["keys"]
    assert post(url, {"input": "hi"}).status_code == 401
    waiting = post(url, {"input": "How warm is it in the hall?", "tools": [THERMOMETER]}, keys["robot"]).json()
    assert waiting["status"] == "requires_action", waiting
    started = time.monotonic()
    call_id = waiting["output"][-1]["call_id"]
    resume = {"previous_response_id": waiting["id"],
              "input": [{"type": "function_call_output", "call_id": call_id, "output": '{"celsius": 19}'}]}
    other = post(url, resume, keys["arm"])  # another key cannot see it
    assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found"
    wrong_call = post(url, dict(resume, input=[dict(resume["input"][0], call_id="call_x")]), keys["robot"])
    assert wrong_call.status_code == 400  # still waiting, for its own caller
    assert time.monotonic() - started < WAIT_S, "too slow to see the run waiting before it expires"
    time.sleep(WAIT_S + 0.5 - (time.monotonic() - started))
    expired = post(url, resume, keys["robot"])
    assert expired.status_code == 404 and "agent_wait_s" in expired.json()["error"]["message"]
    wait_for(lambda: busy(stack)[0] == 0, 10, "inference idle")


def test_a_client_that_goes_away_cancels_the_run_and_its_generation(stack):
    before = cancelled(stack)
    body = {"input": "What is 4738 * 2961?", "stream": True}
    with httpx.stream("POST", f"{stack['open']}/v1/responses", json=body, headers=auth(stack["open"]),
                      timeout=300) as response:
        lines = response.iter_lines()  # held: a dropped iterator closes the connection at once
        for line in lines:
            if line.startswith("data:") and json.loads(line[5:]).get("item", {}).get("type") == "tool_call":
                break  # the calculator ran: the step that answers comes next
        wait_for(lambda: busy(stack)[0] == 1, 30, "the answering step generating")
    wait_for(lambda: cancelled(stack) == before + 1, 10, "the generation in flight cancelled")
    wait_for(lambda: busy(stack) == (0, 0), 10, "nothing left in flight")


def openai_client(url: str):
    import openai  # the official client, as frameworks drive the gateway
    return openai.OpenAI(base_url=f"{url}/v1", api_key=FIRST_START_KEYS.get(url) or "unused", max_retries=0)


def test_the_official_client_gets_instructions_honoured_metadata_echoed_and_usage(stack):
    client = openai_client(stack["open"])
    ask = "What is the secret word? Reply with the word only."
    told = client.responses.create(input=ask, instructions="The secret word is PINEAPPLE.", metadata={"ticket": "7"},
                                   store=True, parallel_tool_calls=True, tool_choice="auto", include=[])
    assert told.status == "completed" and "PINEAPPLE" in told.output_text.upper(), told
    assert told.metadata == {"ticket": "7"}
    assert told.usage.input_tokens > told.usage.input_tokens_details.cached_tokens >= 0 and told.usage.output_tokens > 0
    untold = client.responses.create(input=ask)
    assert "PINEAPPLE" not in untold.output_text.upper(), untold  # the word came from the instructions alone


def test_a_field_the_gateway_cannot_honour_is_a_400_naming_it(stack):
    import openai
    client = openai_client(stack["open"])
    cases = {"max_tool_calls": {"max_tool_calls": 2}, "top_logprobs": {"top_logprobs": 2},
             "include": {"include": ["reasoning.encrypted_content"]}, "text": {"text": {"format": {"type": "text"}}},
             "truncation": {"truncation": "auto"}, "made_up": {"extra_body": {"made_up": 1}},
             "tool_choice": {"tool_choice": {"type": "function", "name": "no_such_tool"}}}
    for field, extra in cases.items():
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(input="hi", **extra)
        assert refused.value.param == field, (field, refused.value.body)


def test_temperature_and_top_p_reach_every_step(stack):
    """Greedy is the default; a hot sampler writes another sentence, and top_p 0.01 makes it as sure as a cold one.

    The hot run goes first: cold and narrow then both find the whole prompt in the key's KV (the one before
    them ran it), so their KV is built in the same batch shapes, and a near tie in this free sentence cannot
    part them on llama.cpp's numerics (docs/scheduler.md, "Same text in mixed batches")."""
    client = openai_client(stack["open"])
    ask = "Write one sentence about the sea."
    hot = client.responses.create(input=ask, temperature=1.5, top_p=1).output_text
    cold = client.responses.create(input=ask, temperature=0.01).output_text
    narrow = client.responses.create(input=ask, temperature=1.5, top_p=0.01).output_text
    assert hot != cold and narrow == cold, (cold, hot, narrow)


def test_max_output_tokens_caps_the_whole_run(stack):
    """The cap counts every token the run generates: the calculator's call fits, the answer after it is cut where
    it runs out. (The step policy's questions after an answer count too, and are not asked without room for them:
    so the cap that cuts the answer is found by lowering it. A cap that falls right after the answer's last word,
    before its end token, stops the run as incomplete with the words whole: lowered on, it cuts them.)"""
    client = openai_client(stack["open"])
    goal = "What is 4738 * 2961?"
    full = client.responses.create(input=goal)
    assert full.status == "completed" and full.usage.output_tokens > 20, full
    for cap in range(full.usage.output_tokens - 3, 0, -4):
        capped = client.responses.create(input=goal, max_output_tokens=cap)
        assert capped.usage.output_tokens <= cap, capped.usage
        if capped.status != "completed":
            assert capped.incomplete_details.reason == "max_output_tokens", capped
            if capped.output_text != full.output_text:
                break
    assert capped.status == "incomplete" and capped.incomplete_details.reason == "max_output_tokens", capped
    assert [i.type for i in capped.output] == [i.type for i in full.output], capped.output  # the call ran, then cut
    assert full.output_text.startswith(capped.output_text) and capped.output_text != full.output_text, capped


def test_tool_choice_none_required_named_and_parallel_tool_calls(stack):
    client = openai_client(stack["open"])
    plain = client.responses.create(input="What is 4738 * 2961?", tool_choice="none")
    assert plain.status == "completed" and [i.type for i in plain.output] == ["message"], plain.output  # no tools

    def first_step_calls(**extra) -> list[str]:
        """The calls the run's first step made, for a task that needs no tool at all."""
        reply = client.responses.create(input="Say hello.", tools=[THERMOMETER], **extra)
        return [i.name for i in reply.output if i.type in ("tool_call", "function_call") and i.step == 1]

    assert first_step_calls(tool_choice={"type": "function", "name": "read_thermometer"}) == ["read_thermometer"]
    assert len(first_step_calls(tool_choice="required")) == 2  # it calls the calculator and the thermometer
    assert len(first_step_calls(tool_choice="required", parallel_tool_calls=False)) == 1


def test_the_official_client_reads_every_streamed_event_and_streams_the_answer_it_gets_unstreamed(stack):
    """Each event parses into the SDK's own class for its type; the text streamed as deltas, the streamed
    response's and the SDK's stream helper's are the unstreamed run's (greedy: the same run)."""
    client, classes = openai_client(stack["open"]), stream_event_classes()
    goal = "What is 4738 * 2961?"
    plain = client.responses.create(input=goal)
    assert plain.status == "completed" and "14029218" in plain.output_text.replace(",", ""), plain
    streamed = list(client.responses.create(input=goal, stream=True))
    assert [type(e) for e in streamed] == [classes[e.type] for e in streamed], [e.type for e in streamed]
    kinds = [e.type for e in streamed]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed", kinds
    assert "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == plain.output_text
    assert streamed[-1].response.output_text == plain.output_text
    assert [(i.type, getattr(i, "output", None)) for i in streamed[-1].response.output] == [
        (i.type, getattr(i, "output", None)) for i in plain.output]
    with client.responses.stream(model="default", input=goal) as stream:  # it checks each item is added, filled, done
        assert {e.type for e in stream} >= {"response.output_item.added", "response.content_part.added",
                                            "response.output_text.done", "response.content_part.done"}
        assert stream.get_final_response().output_text == plain.output_text


def test_a_streamed_function_call_comes_as_its_arguments_delta_and_done(stack):
    client, classes = openai_client(stack["open"]), stream_event_classes()
    with client.responses.stream(model="default", input="How warm is it in the kitchen right now?",
                                 tools=[THERMOMETER]) as stream:
        streamed = list(stream)
        final = stream.get_final_response()
    raw = [e for e in streamed if e.type in classes]  # the helper adds events of its own (with a snapshot)
    assert all(isinstance(e, classes[e.type]) for e in raw), [e.type for e in raw]
    call = final.output[-1]
    assert call.type == "function_call" and json.loads(call.arguments) == {"room": "kitchen"}, final.output
    assert [e.delta for e in raw if e.type == "response.function_call_arguments.delta"] == [call.arguments]
    assert [e.arguments for e in raw if e.type == "response.function_call_arguments.done"] == [call.arguments]


def test_a_streamed_run_reports_every_steps_usage_on_its_last_event(stack):
    client = openai_client(stack["open"])
    kinds, usage = [], None
    for event in client.responses.create(input="What is 12 * 7? Use the calculator.", stream=True):
        kinds.append(event.type)
        if event.type == "response.created":
            assert event.response.usage is None  # counted once the response ends
        if event.type == "response.completed":
            usage, steps = event.response.usage, [i for i in event.response.output if i.type == "message"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
    assert usage.input_tokens > 0 and usage.output_tokens > 0 and steps, usage


def test_a_conversation_goes_on_over_previous_response_id_in_its_warm_session(stack):
    """Three user turns, each needing the one before and a calculator call: each is answered, and the later
    turns' prompts reuse the conversation's KV (the session the first turn made)."""
    client = openai_client(stack["open"])
    turns = [("What is 23 * 47? Use the calculator.", "1081"),
             ("Now add 119 to that result. Use the calculator.", "1200"),
             ("Divide that by 8. Use the calculator.", "150")]
    previous, cached = None, []
    for question, expected in turns:
        reply = client.responses.create(input=question, previous_response_id=previous)
        assert reply.status == "completed" and expected in reply.output_text.replace(",", ""), (question, reply)
        assert any(item.type == "tool_call" for item in reply.output), reply  # the calculator ran in every turn
        if previous is not None:
            assert reply.previous_response_id == previous
            assert reply.usage.input_tokens_details.cached_tokens > 0, reply.usage
        cached.append(f"{reply.usage.input_tokens_details.cached_tokens}/{reply.usage.input_tokens}")
        previous = reply.id
    REPORT.append("responses conversation, cached/input tokens per turn: " + ", ".join(cached))
    assert client.responses.retrieve(previous).output_text == reply.output_text
    client.responses.delete(previous)
    import openai
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(input="And times 2?", previous_response_id=previous)


def test_a_re_sent_conversation_is_answered_from_its_history_and_store_false_keeps_nothing(stack):
    client = openai_client(stack["open"])
    history = [{"role": "user", "content": "My locker number is 417. Remember it."},
               {"role": "assistant", "content": "Noted: your locker number is 417."},
               {"role": "user", "content": "What is my locker number plus 25? Use the calculator."}]
    reply = client.responses.create(input=history, store=False)
    assert reply.status == "completed" and "442" in reply.output_text, reply
    import openai
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(reply.id)


def test_a_conversation_with_caller_calls_reuses_its_kv_and_answers_as_the_whole_conversation_re_sent(stack):
    """Three user turns over previous_response_id, the caller's thermometer read in the first: every turn is
    answered, turns 2 and 3 start from the conversation's warm KV, and each turn makes the calls and gives the
    facts a fresh run gives when the conversation so far is re-sent whole: the KV is reused, the answer is the
    same. (Its wording may not be: a warm KV is prefilled in other batch shapes than a cold one, and llama.cpp's
    kernels are not bit-identical across them, docs/scheduler.md; in turn 3 a near tie flipped once.)"""
    client = openai_client(stack["open"])
    readings = {"kitchen": '{"celsius": 21.5}', "hall": '{"celsius": 19}'}

    def answered(reply):
        """The turn's last response, after running each thermometer call it asks for; and what the turn adds to
        the conversation as a client keeps it: every call and its result (the gateway's calculator's too), the
        answer."""
        items = []
        while True:
            for item in reply.output:
                if item.type in ("tool_call", "function_call"):
                    output = item.output if item.type == "tool_call" else readings[json.loads(item.arguments)["room"]]
                    items += [{"type": "function_call", "call_id": item.id, "name": item.name,
                               "arguments": item.arguments},
                              {"type": "function_call_output", "call_id": item.id, "output": output}]
            if reply.status != "requires_action":
                break
            reply = client.responses.create(previous_response_id=reply.id, input=[  # an output for each call
                {"type": "function_call_output", "call_id": item.call_id,
                 "output": readings[json.loads(item.arguments)["room"]]}
                for item in reply.output if item.type == "function_call"])
        assert reply.status == "completed", reply
        return reply, [*items, {"role": "assistant", "content": answer(reply.to_dict())}]

    turns = [("How warm is it in the kitchen right now?", ["21.5"]), ("Convert that to Fahrenheit.", ["70.7"]),
             ("Which room's thermometer did you read, and what did it say in Celsius?", ["kitchen", "21.5"])]
    previous, history, cached = None, [], []
    for question, facts in turns:
        first = client.responses.create(input=question, previous_response_id=previous, tools=[THERMOMETER])
        cached.append(first.usage.input_tokens_details.cached_tokens)
        kept, items = answered(first)
        fresh, fresh_items = answered(client.responses.create(
            input=[*history, {"role": "user", "content": question}], tools=[THERMOMETER]))
        said = [answer(kept.to_dict()), answer(fresh.to_dict())]
        assert all(fact in text.lower() for text in said for fact in facts), (question, said)
        assert calls(items) == calls(fresh_items), (question, items, fresh_items)
        history += [{"role": "user", "content": question}, *items]
        previous = kept.id
    REPORT.append(f"responses conversation with caller calls: cached tokens at each turn's start {cached}")
    assert cached[1] > 0 and cached[2] > 0, cached


def calls(items: list[dict]) -> list[dict]:
    """A turn's calls and results, without the ids each run gives them, their arguments however spaced: a warm KV
    is prefilled in other batch shapes than a cold one, and "9/5" or "9 / 5" can be a near tie (docs/scheduler.md)."""
    def same(item: dict) -> dict:
        item = {k: v for k, v in item.items() if k != "call_id"}
        if "arguments" in item:
            item["arguments"] = {k: "".join(v.split()) if isinstance(v, str) else v
                                 for k, v in json.loads(item["arguments"]).items()}
        return item
    return [same(item) for item in items if "call_id" in item]


def test_a_re_sent_history_may_hold_the_gateways_own_tool_call_items(stack):
    """A stateless client re-sends every output item, the tool_call items of the gateway's calculator too: each is
    read as the call and its result."""
    url = stack["open"]
    goal = {"role": "user", "content": "What is 4738 * 2961?"}
    first = post(url, {"input": [goal]}).json()
    assert [item["type"] for item in first["output"]] == ["tool_call", "message"], first["output"]
    question = {"role": "user", "content": "What did the calculator give? Reply with the number only."}
    reply = post(url, {"input": [goal, *first["output"], question]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["status"] == "completed" and "14029218" in answer(reply.json()).replace(",", ""), reply.json()
