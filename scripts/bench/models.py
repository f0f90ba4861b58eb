"""Speed and memory of every pulled catalog model on this box, side by side in one run: load, prefill,
decode, resident memory.

Each model gets the same agent-like chat turn (a system prompt, two tools, a question) through
the engine in this process, at temperature 0: the prompt is prefilled cold, then up to
``--max-tokens`` tokens are decoded free. A base model without a chat template gets the same
text as a plain prompt. Medians of ``--reps`` runs. Resident memory is what this process gained
from loading the model to the end of its runs (weights paged in, the 4096-token KV cache, compute
buffers): what a board must hold for the engine with that model, beside the other services.

    .venv/bin/python -m scripts.bench.models [--reps 3] [--max-tokens 128] [--models a,b]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import psutil

from services.inference.prepare import Lexicon
from services.inference.scheduler import GenerateParams, Scheduler
from shared import catalog
from shared.client import chat_request
from shared.config import parse_config
from shared.protocol import ProtocolError

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}},
         {"type": "function", "function": {"name": "read_file", "description": "Read a text file.",
                                           "parameters": {"type": "object", "properties": {
                                               "path": {"type": "string"}}, "required": ["path"]}}}]
MESSAGES = [{"role": "system", "content": "You are the planner of a household robot. Think step by step."},
            {"role": "user", "content": "Write a detailed plan to tidy the kitchen, the hallway and the office, "
                                        "with the order of the rooms, the tools you need and how long each "
                                        "step takes."}]


def measure(name: str, reps: int, max_tokens: int) -> dict:
    model = catalog.get(name)
    process = psutil.Process()
    rss_before = process.memory_info().rss
    t0 = time.perf_counter()
    scheduler = Scheduler.of_one_model(parse_config({"engine": {"model_path": str(model.path()), "n_ctx": 4096,
                                                                "session_slots": 1}}).engine)
    engine = scheduler.models.get(None)[0].engine
    load_s = time.perf_counter() - t0
    try:
        try:
            prompt = Lexicon(name, engine.model_path).chat_turn(chat_request(MESSAGES, tools=TOOLS,
                                                                              tool_choice="none")).prompt
        except ProtocolError:  # a base model: the same words as a plain prompt
            prompt = "\n".join(m["content"] for m in MESSAGES) + "\n"
        runs = [scheduler.complete(prompt, GenerateParams(max_tokens=max_tokens)).stats for _ in range(reps)]
        resident_mib = (process.memory_info().rss - rss_before) / 2**20
    finally:
        scheduler.models.close()
    return {"load_s": round(load_s, 2), "prompt": runs[0].prompt_tokens,
            "prefill": statistics.median(r.prefill_tps for r in runs),
            "decode": statistics.median(r.decode_tps for r in runs),
            "tokens": runs[0].completion_tokens, "resident_mib": round(resident_mib)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--models", help="comma-separated catalog names (default: every pulled model)")
    args = parser.parse_args()
    names = args.models.split(",") if args.models else [m.name for m in catalog.CATALOG.values()
                                                          if catalog.is_pulled(m)]
    rows = {}
    for name in names:
        rows[name] = measure(name, args.reps, args.max_tokens)
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    print(f"\nmedian of {args.reps}; prompt prefilled cold; up to {args.max_tokens} tokens decoded; temperature 0")
    print("| model | file | resident | load s | prompt tokens | prefill tok/s | decode tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {catalog.get(name).size / 2**20:.0f} MiB | {r['resident_mib']} MiB | {r['load_s']} | "
              f"{r['prompt']} | {r['prefill']:.1f} | {r['decode']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
