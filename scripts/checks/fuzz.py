"""Coverage-guided fuzzing (atheris, libFuzzer) of the protocol decoder and every handler's body validation.

    .venv/bin/python -m scripts.checks.fuzz --runs 20000                 # what the test suite runs (a few minutes)
    flock /tmp/magnitude-heavy.lock .venv/bin/python -m scripts.checks.fuzz --runs 1000000   # the long run

Each input is one of:

* ``decoder``: raw bytes as a request frame (``decode_request``) and as a reply (``decode_reply``);
* ``handlers``: a message type and a body built from the input (field names from the MESSAGES table
  and the words the handlers look for, values of every msgpack type), encoded as a frame, decoded,
  and given to the real handler of a real service object built in this process: tools (built-ins),
  optimizer (feedback, telemetry, strategy; its sample intake drained into the real policy),
  retrieval (a real sqlite-vec store; embeddings faked), embedding (validation and the shm reply;
  the model faked), inference (the test instruct model loaded: control messages, tokenize, sessions,
  ``generate``'s validation: prompt/shm, parameters, grammar limits, and ``chat``'s: messages, tools
  and schemas rendered with the model's template into a constraint). Shell templates are filled
  with the fuzzed args too;
* ``gateway``: an HTTP request to the real gateway app (its middlewares, routes, schemas and error
  handlers; nothing behind it, so what passes validation meets ``unavailable``): a route, a body of
  raw bytes or of JSON built like a handler's body, and fuzzed Host, Authorization and X-Session-Id;
* ``tool_calls``: model text (the markup, brackets and words of tool calls) through ``tool_calls.scan``,
  as a stream and as a final reply;
* ``shm``: a shared-memory segment holding fuzzed bytes (a header forged or a real one) taken with a
  fuzzed handle, session and size cap.

The oracle: an input may be answered or refused with a typed ``ProtocolError`` (an HTTP status below
500 for the gateway); any other exception is a finding (libFuzzer stops and prints the input and the
traceback). Counts are printed every ``--report`` inputs and at the end: inputs per target, ok
replies, typed errors by code.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from unittest import mock

import atheris

with atheris.instrument_imports(include=["shared", "services"]):
    from services.embedding.service import EmbeddingService
    from services.gateway.service import GatewayService
    from services.inference.service import InferenceService
    from services.inference.tool_calls import CLOSE, OPEN, scan, tool_table
    from services.optimizer.service import OptimizerService
    from services.retrieval.service import RetrievalService
    from services.tools.service import ToolService, shell_argv
    from shared import catalog, shm
    from shared.config import KNOBS, parse_config
    from shared.protocol import (MESSAGES, FunctionSpec, ProtocolError, Tool, decode_reply, decode_request,
                                 encode_request)
    from shared.service import Emitter

import numpy as np
from starlette.testclient import TestClient

#: Words handlers branch on, so the fuzzer reaches past "unknown key" quickly.
WORDS = sorted({*KNOBS, *(f for spec in MESSAGES.values() for f in spec.fields), "calculator", "file_reader",
                "memory_search", "expression", "path", "query", "k", "generation", "latency_s", "ok", "type",
                "settings", "format", "version", "profile", "decisions", "settled", "name", "key", "kind",
                "dtype", "shape", "size", "id", "text", "metadata", "f16", "q8_0", "lookup", "model", "notes",
                "rss_mb", "completion_tokens", "decode_tps", "ttft_s", "prefill_tokens", "prefill_tps",
                "total_s", "settings_id", "session", "magnitude-strategy", "root ::= \"a\"", "1+2*3", "notes.txt"})
#: Every message type with a body handler (health and metrics are answered by the loop, the watchdog's status
#: reads its supervisor).
FUZZED_SERVICES = ("inference", "embedding", "retrieval", "tools", "optimizer")
TYPES = sorted(t for t, spec in MESSAGES.items() if spec.service in FUZZED_SERVICES)
SHELL_TEMPLATES = ["echo said: {text}", "ls -- {dir}", "robotctl goto --room={room} {speed}", "cp {a}{b} {c}"]
#: The gateway's routes with their methods, and the fields their bodies take.
ROUTES = [("POST", "/v1/chat/completions", ["model", "messages", "tools", "tool_choice", "response_format",
                                             "temperature", "max_tokens", "stream", "stop", "stream_options"]),
          ("POST", "/v1/completions", ["model", "prompt", "max_tokens", "temperature", "echo", "stream", "seed"]),
          ("POST", "/v1/embeddings", ["model", "input", "encoding_format", "dimensions"]),
          ("POST", "/v1/feedback", ["session_id", "success", "error_reason", "details"]),
          ("GET", "/v1/models", []), ("GET", "/v1/models/default", []), ("GET", "/health", []),
          ("GET", "/metrics", []), ("GET", "/openapi.json", []), ("DELETE", "/v1/completions", [])]
HOSTS = ["testserver", "localhost:8000", "127.0.0.1", "[::1]:8000", "evil.example", "", "0.0.0.0:8000", "[::1"]
#: What tool-call text is made of, so the scanner's branches are reached.
TOOL_TEXT = [OPEN, CLOSE, "```json\n", "```python\n", "```", "{", "}", "[", "]", '"name"', '"arguments"', ": ",
             ", ", '"read_thermometer"', '"room"', '"kitchen"', "\n", " ", "null", "1", '"', "\\", "{{", "}}"]
FUZZED_TOOLS = tool_table([
    Tool(type="function", function=FunctionSpec(name="read_thermometer", parameters={
        "type": "object", "properties": {"room": {"enum": ["kitchen"]}}, "required": ["room"]})),
    Tool(type="function", function=FunctionSpec(name="noop"))])
COUNTS: Counter = Counter()


def value(fdp: atheris.FuzzedDataProvider, depth: int = 0):
    """One msgpack-able value of any type, nested up to 3 deep."""
    kind = fdp.ConsumeIntInRange(0, 11 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return fdp.ConsumeBool()
    if kind == 2:
        return fdp.ConsumeIntInRange(-(2 ** 63), 2 ** 64 - 1)
    if kind == 3:
        return fdp.ConsumeIntInRange(-3, 5000)
    if kind == 4:
        return fdp.PickValueInList([0.0, -1.0, 0.5, 1e300, math.inf, -math.inf, math.nan, fdp.ConsumeFloat()])
    if kind == 5:
        return fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 64))
    if kind == 6:
        return fdp.PickValueInList(WORDS)
    if kind == 7:
        return fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 32))
    if kind == 8:
        return "x" * fdp.ConsumeIntInRange(0, 70000)
    if kind == 9:
        return [value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 5))]
    return {key(fdp): value(fdp, depth + 1) for _ in range(fdp.ConsumeIntInRange(0, 5))}


def key(fdp: atheris.FuzzedDataProvider) -> str:
    return fdp.PickValueInList(WORDS) if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(8)


def body_for(fdp: atheris.FuzzedDataProvider, msg_type: str) -> dict:
    fields = list(MESSAGES[msg_type].fields)
    return {fdp.PickValueInList(fields) if fields and fdp.ConsumeIntInRange(0, 4) else key(fdp): value(fdp)
            for _ in range(fdp.ConsumeIntInRange(0, len(fields) + 2))}


class FakeEmbedder:
    """Deterministic unit vectors: the handlers' validation and storage are what is fuzzed, not the model."""

    dim = 384
    model_path = Path("fake.gguf")
    name = "fake"

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """As ``Embedder.embed``: the vectors and the tokens they came from."""
        rng = np.random.default_rng(abs(hash(tuple(texts))) % 2**32)
        vectors = rng.standard_normal((len(texts), self.dim)).astype(np.float32)
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True), sum(len(t.split()) for t in texts)

    def close(self) -> None:
        pass


class _NoOutlet:
    """Where a fuzzed generation would answer: nowhere (only its preparation runs)."""

    def event(self, body: dict) -> None: ...
    def done(self, result: dict) -> None: ...
    def failed(self, exc: Exception) -> None: ...
    def cancelled(self) -> bool:
        return False


class Services:
    """One real service object per service, never bound: the fuzzer calls their handlers directly (the
    gateway's app through an in-process HTTP client)."""

    def __init__(self, home: Path):
        (home / "files").mkdir()
        (home / "files" / "notes.txt").write_text("buy milk\n")
        config = parse_config({
            "agent": {"tools": [{"name": "calculator"}, {"name": "file_reader"}, {"name": "memory_search"}],
                      "file_roots": [str(home / "files")]},
            "engine": {"model_path": str(catalog.get(catalog.TEST_CHAT_MODEL).path()), "n_ctx": 512,
                       "session_slots": 2, "self_optimize": False},
            "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data"), "log_level": "error"},
            "gateway": {"port": 0, "allowed_hosts": ["testserver"], "request_timeout_s": 2},
            "metrics": {"enabled": False}})
        self.inference = InferenceService(config)
        with mock.patch("services.embedding.service.open_embedder", lambda config: FakeEmbedder()):
            self.embedding = EmbeddingService(config)
        self.retrieval = RetrievalService(config)
        self.retrieval._embed = lambda texts: FakeEmbedder().embed(texts)[0]
        self.tools = ToolService(config)
        self.optimizer = OptimizerService(config)
        self.http = TestClient(GatewayService(config).http.server.config.app)
        self.by_name = {s.name: s for s in (self.inference, self.embedding, self.retrieval, self.tools,
                                             self.optimizer)}

    def release_segments(self) -> None:
        for service in self.by_name.values():
            service.shm_pool.close()

    def handle(self, req) -> None:
        service = self.by_name[MESSAGES[req.type].service]
        emit = Emitter(lambda kind, body: None)
        if req.type in ("generate", "chat"):  # the preparing workers' part: everything before the scheduler
            self.inference.preparer.prepare(req, "fuzz", _NoOutlet())
        elif service is self.inference and req.type in self.inference.control.handlers:
            self.inference.control.run(req)
        else:
            service._handlers[req.type](req, emit)
        if req.type == "telemetry":
            self.optimizer.tuner.ingest(timeout_s=0.001)  # on into the policy, as the controller thread does
        if req.type == "tool.call" and isinstance(req.body.get("args"), dict):
            for template in SHELL_TEMPLATES:
                try:
                    shell_argv(template, req.body["args"])
                except ProtocolError:
                    pass


def gateway_input(fdp: atheris.FuzzedDataProvider, http: TestClient) -> None:
    method, path, fields = fdp.PickValueInList(ROUTES)
    # Header values as bytes: they reach the app as sent (the HTTP client would refuse non-ASCII text).
    headers = {"host": fdp.PickValueInList(HOSTS).encode() if fdp.ConsumeIntInRange(0, 7) else fdp.ConsumeBytes(12)}
    if fdp.ConsumeBool():
        headers["authorization"] = b"Bearer " + fdp.ConsumeBytes(12)
    if fdp.ConsumeBool():
        headers["x-session-id"] = fdp.ConsumeBytes(8)
    if fdp.ConsumeBool():
        body = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2048))
    else:
        document = {fdp.PickValueInList(fields) if fields and fdp.ConsumeIntInRange(0, 4) else key(fdp): value(fdp)
                    for _ in range(fdp.ConsumeIntInRange(0, len(fields) + 2))}
        body = json.dumps(document, default=lambda v: v.hex() if isinstance(v, bytes) else str(v)).encode()
    answer = http.request(method, path, content=body, headers={**headers, "content-type": b"application/json"})
    COUNTS[f"http:{answer.status_code}"] += 1
    if answer.status_code >= 500 and answer.status_code != 503:  # 503: nothing runs behind it, as intended
        raise AssertionError(f"{method} {path} answered {answer.status_code}: {answer.text[:500]}")


def tool_call_input(fdp: atheris.FuzzedDataProvider) -> None:
    text = "".join(fdp.PickValueInList(TOOL_TEXT) if fdp.ConsumeIntInRange(0, 3) else
                   fdp.ConsumeUnicodeNoSurrogates(4) for _ in range(fdp.ConsumeIntInRange(0, 40)))
    final = scan(text, FUZZED_TOOLS, final=True)
    streamed = scan(text, FUZZED_TOOLS, final=False)
    assert final.content.startswith(streamed.content) or streamed.calls, (text, final, streamed)


def shm_input(fdp: atheris.FuzzedDataProvider) -> None:
    """A segment of fuzzed bytes, or a real one, taken with a fuzzed handle."""
    session = fdp.PickValueInList([None, "a", "b"])
    if fdp.ConsumeBool():
        handle = shm.put_bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 512)), session_id=session)
        name = handle["name"]
    else:
        raw = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 600))
        segment = shm._create(len(raw))  # noqa: SLF001 - a segment in our name format, of whatever bytes
        segment.buf[:len(raw)] = raw
        name = segment.name
        segment.close()
        handle = {"name": name, "key": raw[4:20].hex() if len(raw) >= 20 else "0" * 32, "kind": "bytes"}
    for field in ("name", "key", "size", "session"):
        if fdp.ConsumeIntInRange(0, 3) == 0:
            handle[field] = value(fdp)
    try:
        shm.take_bytes(handle, fdp.PickValueInList([session, "b", None]),
                       max_bytes=fdp.ConsumeIntInRange(0, 1024))
    finally:
        shm.unlink(name)


def decoder_input(fdp: atheris.FuzzedDataProvider, services: Services) -> None:
    frame = fdp.ConsumeBytes(fdp.remaining_bytes())
    try:
        decode_reply(frame)
    except ProtocolError:
        pass
    decode_request(frame, max_frame_bytes=1 << 20, handled=set(MESSAGES))


def handler_input(fdp: atheris.FuzzedDataProvider, services: Services) -> None:
    msg_type = fdp.PickValueInList(TYPES)
    session = None if fdp.ConsumeBool() else fdp.ConsumeUnicodeNoSurrogates(16) or None
    frame = encode_request(msg_type, body_for(fdp, msg_type), session=session)
    services.handle(decode_request(frame, max_frame_bytes=1 << 20, handled=set(MESSAGES)))


#: Targets by the input's first choice: half go to the handlers, an eighth to each of the others.
TARGETS = {"decoder": decoder_input, "gateway": lambda fdp, services: gateway_input(fdp, services.http),
           "tool_calls": lambda fdp, services: tool_call_input(fdp), "shm": lambda fdp, services: shm_input(fdp),
           "handlers": handler_input}
PICKS = ["decoder", "gateway", "tool_calls", "shm"] + ["handlers"] * 4


def one_input(data: bytes, services: Services) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    target = PICKS[fdp.ConsumeIntInRange(0, len(PICKS) - 1)]
    COUNTS["inputs"] += 1
    COUNTS[target] += 1
    try:
        TARGETS[target](fdp, services)
        COUNTS["ok"] += 1
    except ProtocolError as err:
        COUNTS[f"error:{err.code}"] += 1


def report() -> None:
    counts = dict(sorted(COUNTS.items()))
    print(f"fuzz counts: inputs={counts.pop('inputs', 0)} " + " ".join(f"{k}={v}" for k, v in counts.items()),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20000, help="inputs to try (libFuzzer -runs)")
    parser.add_argument("--report", type=int, default=0, help="print counts every N inputs (default runs/10)")
    parser.add_argument("--seed", type=int, default=1, help="libFuzzer -seed (0: random)")
    args, libfuzzer_args = parser.parse_known_args()
    every = args.report or max(1000, args.runs // 10)
    home = Path(tempfile.mkdtemp(prefix="magfuzz", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    services = Services(home)
    print(f"fuzzing {len(TYPES)} message types' handlers and the decoder; {args.runs} inputs; work dir {home}",
          flush=True)

    def test_one(data: bytes) -> None:
        one_input(data, services)
        if COUNTS["inputs"] % every == 0:
            report()
        if COUNTS["inputs"] % 1000 == 0:  # replies that put payloads in shm: nobody takes them here
            services.release_segments()

    atexit.register(report)
    atheris.Setup([sys.argv[0], f"-runs={args.runs}", f"-seed={args.seed}", "-rss_limit_mb=4096",
                   "-max_len=4096", f"-artifact_prefix={home}/", *libfuzzer_args], test_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
