"""Constrained vs free decoding speed, side by side on the same prompts: Magnitude and llama-server.

Each workload is one prompt decoded free and under its constraint, alternating per
repetition, at temperature 0: a JSON-schema answer (``response_format``), a tool call
(``tool_choice: required``), a tool call the model opens by itself (``auto``: the lazy
grammar takes over at ``<tool_call>``), and a Thought/Action step under a GBNF grammar from
llama-cpp-python's JSON-schema converter through ``generate`` (the agent's former path). Magnitude runs the engine in this process (llguidance token masks;
llama.cpp's GBNF sampler for grammars llguidance cannot take); llama-server (built by
native/build_llama_server.sh from the same llama.cpp) gets the same messages through
its OpenAI endpoint with ``--jinja`` (GBNF from the schema). It prints decode tokens/s
(median), the cost of the constraint, how many tokens the grammar forced (decoded
like drafts, never sampled), and the time spent in the constraint per token.

    .venv/bin/python -m scripts.bench.constrained [--model qwen2.5-coder-0.5b] [--reps 3] [--no-llama-server]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from gguf import GGUFReader
from llama_cpp.llama_grammar import json_schema_to_gbnf

from scripts.bench import llama_server
from scripts.bench.stats import median, ratio
from services.inference.constraint import Constraint, LlamaGrammar, gbnf_constraint
from services.inference.prepare import Lexicon
from services.inference.scheduler import GenerateParams, Scheduler
from shared import catalog
from shared.client import chat_request
from shared.config import parse_config


PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "skills": {"type": "array", "items": {"type": "string"}}, "employed": {"type": "boolean"}},
    "required": ["name", "age", "city", "skills", "employed"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "write_file", "description": "Write a text file.", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
        "required": ["path", "text"]}}}]
PERSON_ASK = [{"role": "user", "content": "Invent a software engineer and describe them as JSON with name, age, "
                                           "city, skills and employed."}]
TOOL_ASK = [{"role": "user", "content": "Save a short poem about the sea (four lines) to poem.txt."}]
#: name -> (chat body with its constraint; the same body with the constraint taken off)
CHAT_WORKLOADS = {
    "json_schema answer": ({"messages": PERSON_ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}, {"messages": PERSON_ASK}),
    "tool call, required": ({"messages": TOOL_ASK, "tools": TOOLS, "tool_choice": "required"},
                            {"messages": TOOL_ASK, "tools": TOOLS, "tool_choice": "none"}),
    "tool call, auto (lazy)": ({"messages": TOOL_ASK, "tools": TOOLS, "tool_choice": "auto"},
                               {"messages": TOOL_ASK, "tools": TOOLS, "tool_choice": "none"}),
}
#: A Thought/Action step as the agent used to write it: a GBNF grammar from llama-cpp-python's JSON-schema converter
#: (its bounded strings nest one level per character), given to generate.
ACTION_GRAMMAR = json_schema_to_gbnf(json.dumps({"anyOf": [
    {"type": "object", "properties": {"tool": {"const": t["function"]["name"]}, "args": {
        **t["function"]["parameters"], "properties": {k: {**v, "maxLength": 200} for k, v in
                                                      t["function"]["parameters"]["properties"].items()}}},
     "required": ["tool", "args"], "additionalProperties": False} for t in TOOLS]}))
ACTION = "GBNF Action (generate)"
ACTION_PROMPT = ("Answer with a Thought and an Action.\nQuestion: Save the note 'buy milk' to notes.txt, then tell "
                 "me it is done.\nThought: I should write the file.\nAction: ")


class ConstraintClock:
    """Time spent inside the constraints' methods (what constrained decoding adds per token), by wrapping them."""

    def __init__(self):
        self.seconds = 0.0
        for cls in (Constraint, LlamaGrammar):
            for name in ("allows", "mask", "accept", "forced"):
                setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, method):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed


def _median(values: list[float]) -> float:
    return round(median(values), 1)


def magnitude_rows(model_path: Path, reps: int, max_tokens: int, workloads: list[str]) -> dict[str, dict]:
    scheduler = Scheduler.of_one_model(parse_config({"engine": {"model_path": str(model_path), "n_ctx": 4096,
                                                                "session_slots": 1}}).engine)
    engine = scheduler.models.get(None)[0].engine
    lexicon = Lexicon("default", engine.model_path)
    clock = ConstraintClock()
    out = {}
    try:
        for name in workloads:
            tps = {"free": [], "constrained": []}
            forced, overhead = [], []
            for _ in range(reps):
                for mode in ("free", "constrained"):
                    params = GenerateParams(max_tokens=max_tokens)
                    clock.seconds = 0.0
                    if name == ACTION:
                        prompt = ACTION_PROMPT
                        constraint = gbnf_constraint(ACTION_GRAMMAR, engine.model) if mode == "constrained" else None
                    else:  # a fresh turn each run: a constraint's state is one generation's
                        body = CHAT_WORKLOADS[name][0 if mode == "constrained" else 1]
                        turn = lexicon.chat_turn(chat_request(**body))
                        prompt, constraint = turn.prompt, turn.constraint
                    result = scheduler.complete(prompt, params, constraint=constraint).stats
                    if result.decode_tps:
                        tps[mode].append(result.decode_tps)
                    if mode == "constrained":
                        forced.append(result.forced_tokens / max(result.completion_tokens, 1))
                        overhead.append(clock.seconds / max(result.completion_tokens, 1))
            out[name] = {"free": _median(tps["free"]), "constrained": _median(tps["constrained"]),
                         "forced": round(100 * median(forced)) if forced else 0,
                         "us_per_token": round(1e6 * median(overhead)) if overhead else 0}
            print(f"magnitude  {name}: {out[name]}", file=sys.stderr, flush=True)
    finally:
        scheduler.models.close()
    return out


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def llama_server_rows(binary: str, model_path: Path, reps: int, max_tokens: int, threads: int,
                      workloads: list[str]) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".log") as log, llama_server.LlamaServer(binary, model_path, [
            "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1", "--jinja", "--no-webui"],
            Path(log.name), timeout_s=120) as server:
        out = {}
        for name in workloads:
            tps = {"free": [], "constrained": []}
            for _ in range(reps):
                for mode in ("free", "constrained"):
                    common = {"max_tokens": max_tokens, "n_predict": max_tokens, "temperature": 0,
                              "cache_prompt": False}
                    if name in CHAT_WORKLOADS:
                        body = CHAT_WORKLOADS[name][0 if mode == "constrained" else 1]
                        timings = _post(server.port, "/v1/chat/completions", {**body, **common})["timings"]
                    else:
                        body = {"prompt": ACTION_PROMPT, **common}
                        if mode == "constrained":
                            body["grammar"] = ACTION_GRAMMAR
                        timings = _post(server.port, "/completion", body)["timings"]
                    tps[mode].append(timings["predicted_per_second"])
            out[name] = {"free": _median(tps["free"]), "constrained": _median(tps["constrained"])}
            print(f"llama-server  {name}: {out[name]}", file=sys.stderr, flush=True)
        return out


def _cost(row: dict) -> str:
    return f"{100 * (1 - ratio(row['constrained'], row['free'])):+.0f}%" if row.get("free") else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=catalog.TEST_CHAT_MODEL, help="a catalog model name or a GGUF path")
    parser.add_argument("--reps", type=int, default=3, help="runs per workload and mode (median reported)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (Magnitude: one per core)")
    parser.add_argument("--no-llama-server", action="store_true", help="Magnitude only")
    args = parser.parse_args()
    model_path = catalog.get(args.model).path() if args.model in catalog.CATALOG else Path(args.model)
    if not model_path.is_file():
        sys.exit(f"no model at {model_path} (magnitude models pull {args.model})")

    # A base model (no chat template) gets the generate workload only.
    workloads = ([ACTION] if "tokenizer.chat_template" not in GGUFReader(str(model_path)).fields
                 else list(CHAT_WORKLOADS) + [ACTION])
    mag = magnitude_rows(model_path, args.reps, args.max_tokens, workloads)
    peer, version = {}, None
    if not args.no_llama_server:
        binary = llama_server.build()
        version = llama_server.version(binary)
        peer = llama_server_rows(binary, model_path, args.reps, args.max_tokens, args.threads, workloads)
    print(f"\nmodel {model_path.name}; decode tokens/s, median of {args.reps}; temperature 0; "
          f"max_tokens {args.max_tokens}" + (f"; llama-server {version}" if version else ""))
    print("| workload | Magnitude free | constrained | cost | forced tokens | constraint us/token | "
          "llama-server free | constrained | cost |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, row in mag.items():
        p = peer.get(name, {})
        print(f"| {name} | {row['free']} | {row['constrained']} | {_cost(row)} | {row['forced']}% | "
              f"{row['us_per_token']} | "
              f"{p.get('free', '-')} | {p.get('constrained', '-')} | {_cost(p) if p else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
