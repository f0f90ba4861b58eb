"""One engine shared by many clients, tried from outside as they use it: the official openai SDK on the gateway.

What every client relies on: session reuse never changes an answer; a plain tool loop solves as much with
``X-Session-Id`` as without; a client that goes away frees what it held at once; one hostile request (a
backtracking regex in a tool schema) neither stalls another session's stream nor gets inference restarted.

The stack: inference (the default agent model as ``default``, the test chat model by its catalog name), the
tools service (calculator, file_reader over the benchmark's files) and the gateway.
"""

from __future__ import annotations

import threading
import time

import openai
import pytest
from openai import OpenAI

from scripts.bench.agent.runners import ToolBox, peer_task
from scripts.bench.agent.tasks import FILES, TASKS, write_files
from services.gateway.keys import read_local_key
from shared import catalog
from shared.client import Client
from shared.config import parse_config
from shared.protocol import encode_request, new_request_id
from tests.conftest import (REPORT, ServiceProcess, gaps_while, make_config, require_model, wait_for,
                            write_config)

pytestmark = pytest.mark.model

AGENT_MODEL = catalog.DEFAULT_AGENT_MODEL
CHAT_MODEL = catalog.TEST_CHAT_MODEL
#: Tasks whose answers need one or two dependent tool calls over files and the calculator.
LOOP_TASKS = [t for t in TASKS if t.kind == "file"][:4] + \
             [t for t in TASKS if t.kind == "two_tools" and "memories" not in t.goal][:4]


@pytest.fixture(scope="module")
def stack(run_home):
    agent_path, chat_path = catalog.get(AGENT_MODEL).path(), catalog.get(CHAT_MODEL).path()
    require_model(agent_path)
    require_model(chat_path)
    home = run_home / "shared-engine"
    write_files(home / "files", FILES)
    # Prompt chunks of 8 tokens beside running decodes: a step then costs about one decode, so the regex test
    # measures what preparation does to another stream, not how long a 32-token chunk takes (about 180 ms
    # on the 0.5B here, which alone came close to the 250 ms bound).
    base = make_config(home, model_path=str(agent_path), n_ctx=4096, session_slots=4, max_models=2,
                       prefill_chunk_size=8, models={CHAT_MODEL: str(chat_path)})
    config = parse_config({**base.model_dump(mode="json"),
                           "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}],
                                     "file_roots": [str(home / "files")]},
                           "runtime": {**base.runtime.model_dump(mode="json"), "queue_size": 32}})
    path = write_config(home, config)
    services = [ServiceProcess(name, path, config).start() for name in ("inference", "tools", "gateway")]
    with Client(services[-1].endpoint, timeout_s=5) as c:
        url = c.health()["url"]
    yield {"config": config, "url": f"{url}/v1", "inference": services[0], "key": read_local_key(config)}
    for svc in reversed(services):
        svc.stop()


def sdk(stack, session: str | None = None, **kwargs) -> OpenAI:
    headers = {"X-Session-Id": session} if session else None
    return OpenAI(base_url=stack["url"], api_key=stack["key"], max_retries=0, timeout=kwargs.pop("timeout", 300),
                  default_headers=headers, **kwargs)


def inference_health(stack) -> dict:
    with Client.for_service("inference", stack["config"], timeout_s=5) as c:
        return c.health()


def test_a_tool_conversation_answers_the_same_with_and_without_a_session(stack):
    """Four turns, one of them a call the client kept as the model's fenced JSON text: every reply at
    temperature 0 is the same with the session's KV as without a session, and the later turns reuse KV."""
    tools = [{"type": "function", "function": {
        "name": "read_sensor", "description": "The reading of a robot sensor.",
        "parameters": {"type": "object", "properties": {"sensor": {"type": "string",
                                                                   "enum": ["battery", "temperature"]}},
                       "required": ["sensor"]}}}]
    fenced = '```json\n{"name": "read_sensor", "arguments": {"sensor": "temperature"}}\n```'
    script = [
        [{"role": "system", "content": "You are a robot's assistant. Use a tool when you need a reading."},
         {"role": "user", "content": "How full is the battery?"}],
        None,  # the model's reply, then the tool result for its call (if any)
        [{"role": "user", "content": "And the temperature?"},
         {"role": "assistant", "content": fenced},
         {"role": "user", "content": "The tool said: 21.5 degrees. Tell me in one sentence."}],
        [{"role": "user", "content": "Thanks. Which reading was lower in number?"}],
    ]
    session, with_session, without = f"conv-{time.monotonic_ns()}", sdk(stack), sdk(stack)
    messages: list[dict] = []
    cached = []
    for turn in script:
        if turn is None:
            continue
        messages += turn
        args = dict(model=CHAT_MODEL, messages=messages, tools=tools, max_tokens=48, temperature=0)
        reused = with_session.chat.completions.create(**args, extra_headers={"X-Session-Id": session})
        fresh = without.chat.completions.create(**args)
        a, b = reused.choices[0].message, fresh.choices[0].message
        assert a.content == b.content
        assert [(c.function.name, c.function.arguments) for c in a.tool_calls or []] == \
               [(c.function.name, c.function.arguments) for c in b.tool_calls or []]
        cached.append(reused.usage.prompt_tokens_details.cached_tokens)
        messages.append(a.model_dump(exclude_none=True))
        for call in a.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "87 %"})
    assert len(cached) >= 3 and all(n > 0 for n in cached[1:]), cached
    REPORT.append(f"same replies with and without a session over {len(cached)} turns; cached tokens {cached}")


def test_a_plain_openai_tool_loop_solves_as_much_with_session_headers(stack):
    """The agent benchmark's plain loop (no Magnitude agent code) on the default model, each task once with a session
    id and once without: session reuse must never cost a task (it used to make the model repeat its call)."""
    solved = {}
    with Client.for_service("tools", stack["config"], timeout_s=60) as tools:
        box = ToolBox(tools)
        for mode in ("session", "none"):
            outcomes = []
            for i, task in enumerate(LOOP_TASKS):
                client = sdk(stack, f"loop-{i}-{time.monotonic_ns()}" if mode == "session" else None)
                outcomes.append(peer_task(client, box, task, max_steps=6, max_tokens=256,
                                          model="default"))
            solved[mode] = [o.ok for o in outcomes]
            REPORT.append(f"plain openai loop, {mode}: {sum(solved[mode])}/{len(LOOP_TASKS)} solved, "
                          f"{sum(o.steps for o in outcomes)} steps")
    assert len(LOOP_TASKS) >= 8
    assert sum(solved["session"]) >= sum(solved["none"]) and sum(solved["session"]) >= len(LOOP_TASKS) // 2, solved


def test_dropped_clients_free_their_generations(stack):
    """Eight streams of 4096 tokens dropped after their first chunk, and a whole request whose client gives up:
    inference holds nothing of them 2 s later, and a short request is answered at once."""
    def drop_after_first_chunk(i: int) -> None:
        stream = sdk(stack).chat.completions.create(
            model=CHAT_MODEL, stream=True, max_tokens=4096, temperature=0.7, seed=i,
            messages=[{"role": "user", "content": f"Write a very long story about robot number {i}."}])
        next(iter(stream))
        stream.close()

    threads = [threading.Thread(target=drop_after_first_chunk, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    # A whole (not streamed) request whose client stops waiting. Greedy, since the 0.5B sampled at 0.7 answers
    # "I'm sorry, but I can't assist with that request." about one time in 13, well within the client's 1.5 s.
    with pytest.raises(openai.APITimeoutError):
        sdk(stack, timeout=1.5).chat.completions.create(
            model=CHAT_MODEL, max_tokens=4096, temperature=0,
            messages=[{"role": "user", "content": "Write a very long story about a lighthouse."}])
    dropped = time.monotonic()
    wait_for(lambda: inference_health(stack)["generations_in_flight"] == 0, 2.0, "nothing in flight 2 s after")
    REPORT.append(f"dropped clients: inference idle {time.monotonic() - dropped:.2f} s after the last one left")
    t0 = time.monotonic()
    reply = sdk(stack).completions.create(model=CHAT_MODEL, prompt="The robot said", max_tokens=4, temperature=0)
    assert reply.usage.completion_tokens == 4 and time.monotonic() - t0 < 5


def test_a_backtracking_regex_neither_stalls_another_stream_nor_restarts_inference(stack):
    """A tool schema with ^(a+)+$ and a reply that writes a long run of a's and a '!': RE2 answers it in linear
    time, off the decode thread; another session's stream keeps the pace it keeps beside the same request with
    a plain schema, and inference keeps its process."""
    pid = inference_health(stack)["pid"]
    call_text = '[{"name": "echo", "arguments": {"text": "' + "a" * 60 + '!"}}]'

    def gaps_beside(text_schema: dict) -> tuple[list[float], dict]:
        """The other stream's gaps while a request whose tool takes ``text_schema`` is answered."""
        tools = [{"type": "function", "function": {
            "name": "echo", "description": "Echo a text.",
            "parameters": {"type": "object", "properties": {"text": text_schema}, "required": ["text"]}}}]
        request: dict = {}

        def send() -> None:
            t0 = time.monotonic()
            try:
                request["reply"] = sdk(stack).chat.completions.create(
                    model=CHAT_MODEL, tools=tools, max_tokens=96, temperature=0,
                    messages=[{"role": "user", "content": f"Reply with exactly this text and nothing else: {call_text}"}])
            except openai.BadRequestError as err:
                request["refused"] = err
            request["seconds"] = time.monotonic() - t0

        stream = sdk(stack, f"steady-{time.monotonic_ns()}").completions.create(
            model=CHAT_MODEL, prompt="Count from one to two hundred in words: one, two,", max_tokens=400,
            temperature=0, stream=True)
        gaps = gaps_while(stream, 8, send)
        stream.close()
        assert "seconds" in request and request["seconds"] < 60
        return gaps, request

    plain_gaps, _ = gaps_beside({"type": "string"})
    hostile_gaps, hostile = gaps_beside({"type": "string", "pattern": "^(a+)+$"})
    REPORT.append(f"regex request answered in {hostile['seconds']:.2f} s; the other stream's longest gap meanwhile "
                  f"{max(hostile_gaps) * 1000:.0f} ms over {len(hostile_gaps)} tokens, beside the same request "
                  f"with a plain schema {max(plain_gaps) * 1000:.0f} ms over {len(plain_gaps)}")
    # The pace is this box's, and one step of any tool request beside the stream costs it a little (measured
    # side by side, not as an absolute): a stall is a gap a quarter second beyond the plain request's longest.
    assert max(hostile_gaps) <= max(plain_gaps) + 0.25, (hostile_gaps, plain_gaps)
    health = inference_health(stack)
    assert health["pid"] == pid and health["ok"]


def test_one_client_has_at_most_its_share_of_generations_and_cancel_frees_them(stack):
    """One connection sends one generation more than runtime.max_generations_per_client: that one is refused
    busy at once; a ``cancel`` per id then ends the others, and nothing is left in flight."""
    limit = stack["config"].runtime.max_generations_per_client
    ids = [new_request_id() for _ in range(limit + 1)]
    with Client.for_service("inference", stack["config"], timeout_s=30) as c:
        for rid in ids:
            c.send_raw(encode_request("generate", {"prompt": "Tell a long story.", "max_tokens": 500,
                                                   "model": CHAT_MODEL}, request_id=rid))
        refused = c.recv_reply(timeout_s=30)
        assert (refused.id, refused.kind, refused.error_code) == (ids[-1], "error", "busy")
        for rid in ids[:-1]:
            c.send_raw(encode_request("cancel", {"id": rid}))
        finals = {}
        while len(finals) < limit:
            reply = c.recv_reply(timeout_s=30)
            if reply.final and reply.id in ids:
                finals[reply.id] = reply.error_code
    assert set(finals.values()) == {"cancelled"}
    wait_for(lambda: inference_health(stack)["generations_in_flight"] == 0, 2.0, "nothing in flight")


def test_after_inference_restarts_requests_in_flight_fail_fast_and_new_ones_are_served(stack):
    """Inference killed mid-stream (what the watchdog then restarts): the HTTP stream and a ZeroMQ stream end
    with an error at once instead of waiting out their deadlines; once inference is back, both serve again
    within 5 s."""
    long_story = [{"role": "user", "content": "Write a very long story about a robot that learns to cook."}]
    http_stream = sdk(stack).chat.completions.create(model=CHAT_MODEL, messages=long_story, max_tokens=2000,
                                                     temperature=0, stream=True)
    chunks = iter(http_stream)
    next(chunks)
    zmq_client = Client.for_service("inference", stack["config"], timeout_s=120)
    zmq_stream = zmq_client.generate_stream("Count slowly to one thousand:", max_tokens=2000, model=CHAT_MODEL)
    next(zmq_stream)
    stack["inference"].proc.kill()
    killed = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in chunks:
            pass
    http_s = time.monotonic() - killed
    with pytest.raises(Exception) as err:
        for _ in zmq_stream:
            pass
    zmq_s = time.monotonic() - killed
    assert getattr(err.value, "code", None) == "unavailable", err.value
    assert http_s < 5 and zmq_s < 5, (http_s, zmq_s)
    stack["inference"].start()
    back = time.monotonic()
    reply = sdk(stack, timeout=5).completions.create(model=CHAT_MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    assert zmq_client.generate("Hello", max_tokens=2, model=CHAT_MODEL).stats.completion_tokens == 2
    assert time.monotonic() - back < 5
    zmq_client.close()
    REPORT.append(f"inference killed mid-stream: the HTTP stream failed after {http_s:.2f} s, the ZeroMQ one after "
                  f"{zmq_s:.2f} s; served again {time.monotonic() - back:.2f} s after it was back")
