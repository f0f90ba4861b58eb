"""One agent's decode speed, plain and with drafting, side by side with llama-server in one run.

Where agents spend their tokens: writing text (nothing to copy), echoing a file they read with one
change, repeating tool-call JSON in a fixed shape, and multi-step tool sessions. Each workload runs on
both sides with drafting off and on:

  plain     write a story: nothing in the context to copy
  echo      print a 25-line Python file back with one function renamed
  tooljson  continue a log of tool calls, one JSON object per line, for more rooms
  traces    three scripted tool sessions (read a file and write it back fixed, edit a JSON config,
            add up readings from a log); tool results are canned, each step's prompt is the session so
            far with the side's own earlier replies

Both sides get the same prompt text (the model's ChatML chat format written out, tools in Qwen's
format), the same model, threads and ``max_tokens``, temperature 0, one slot, ``cache_prompt``.
Magnitude drafts with its n-gram lookup (``spec_draft_tokens: --draft``, draft lengths chosen per
session from measured acceptance); llama-server with each of its n-gram speculative types
(``--spec-type``, ``--spec-draft-n-max --draft``). Decode tok/s is measured by the client: tokens
after the first over the time from the first to the last streamed text, summed over a trace's steps.
At temperature 0 every mode of a side must write the text its plain mode wrote; the table says
whether each pair did.

    .venv/bin/python -m scripts.bench.drafting                       # every workload, 1 rep
    .venv/bin/python -m scripts.bench.drafting --reps 3 --workloads echo tooljson
    .venv/bin/python -m scripts.bench.drafting --only magnitude      # while iterating
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

from scripts.bench import llama_server
from scripts.bench.backends import MagnitudeBackend, Sample, ServerBackend
from scripts.bench.common import stop_services_on_sigterm
from scripts.bench.spec_chat import FILES, TASKS, TOOLS, run_tool
from scripts.bench.stats import median, ratio
from shared import catalog
from shared.client import Client

SERVER_MODES = ["ngram-simple", "ngram-map-k", "ngram-mod"]


def chatml(messages: list[dict], tools: list[dict] | None = None) -> str:
    """The conversation in Qwen2.5's chat format, ready for the assistant's turn (its template, written out)."""
    out = []
    for i, m in enumerate(messages):
        content = m["content"]
        if i == 0 and m["role"] == "system" and tools:
            content += ("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
                        + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n\nFor each function call, return "
                        "a json object with function name and arguments within <tool_call></tool_call> XML tags:"
                        "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>")
        if m["role"] == "tool":
            out.append(f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n")
        else:
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
    return "".join(out) + "<|im_start|>assistant\n"


def user(text: str) -> str:
    return chatml([{"role": "system", "content": "You are a helpful coding assistant."},
                   {"role": "user", "content": text}])


ROOMS = ["kitchen", "hallway", "bedroom", "bathroom", "office", "garage"]
PROMPTS = {
    "plain": (user("Write a long, detailed story about a robot that learns to cook."), 200),
    "echo": (user("Here is geometry.py:\n```python\n" + FILES["geometry.py"] + "```\nRename the function "
                  "rectangle_area to rect_area and print the whole file, changed, in one code block. "
                  "Nothing else."), 300),
    "tooljson": (user("These tool calls checked the first rooms, one JSON object per line:\n" + "".join(
        json.dumps({"name": "inspect", "arguments": {"room": r, "camera": "front", "lights": "on", "report": True}})
        + "\n" for r in ROOMS[:3]) + "Write the same calls for the rooms " + ", ".join(ROOMS[3:]) + " and then "
        "the three first ones again, one JSON object per line, nothing else."), 300),
}
#: A tool call as the model writes it: in Qwen's <tool_call> tags or, as small models often write it, in a ```json block.
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>|```(?:json)?\s*(\{.*?\})\s*```", re.S)


def run_prompt(backend, name: str, rep: int) -> tuple[list[Sample], str]:
    prompt, max_tokens = PROMPTS[name]
    sample = backend.complete(0, prompt, max_tokens, session=f"{name}-{rep}-{id(backend)}")
    return [sample], sample.text


def run_traces(backend, rep: int, max_steps: int = 4) -> tuple[list[Sample], str]:
    """Every task as a tool session; the samples of every step and every reply, in order."""
    samples, replies = [], []
    for i, task in enumerate(TASKS):
        messages = [{"role": "system", "content": "You are a careful assistant with tools. Use them."},
                    {"role": "user", "content": task}]
        for _ in range(max_steps):
            sample = backend.complete(0, chatml(messages, TOOLS), 400, session=f"trace-{i}-{rep}-{id(backend)}")
            samples.append(sample)
            replies.append(sample.text)
            messages.append({"role": "assistant", "content": sample.text})
            calls = [tagged or fenced for tagged, fenced in TOOL_CALL.findall(sample.text)]
            if not calls:
                break
            for raw in calls:
                try:
                    call = json.loads(raw)
                    result = run_tool(str(call.get("name")), dict(call.get("arguments") or {}))
                except (ValueError, TypeError, AttributeError):
                    result = "error: the tool call is not valid JSON"
                messages.append({"role": "tool", "content": result})
    return samples, json.dumps(replies)


def tok_s(samples: list[Sample]) -> float:
    tokens = sum(s.tokens - 1 for s in samples if s.decode_tps)
    seconds = sum((s.tokens - 1) / s.decode_tps for s in samples if s.decode_tps)
    return tokens / seconds if seconds else 0.0


def run_workload(backend, name: str, rep: int) -> tuple[float, str, int]:
    samples, text = run_traces(backend, rep) if name == "traces" else run_prompt(backend, name, rep)
    return tok_s(samples), text, sum(s.tokens for s in samples)


class Magnitude(MagnitudeBackend):
    """One service for both modes: drafting is a hot setting (``engine.configure``)."""

    def mode(self, draft: int) -> None:
        client = Client.for_service("inference", self.config)
        client.request("engine.configure", {"settings": {"spec_draft_tokens": draft, "spec_drafter": "lookup"}})
        client.close()


def print_table(args, tps: dict[tuple[str, str], list[float]], texts: dict[tuple[str, str], str],
                tokens: dict[tuple[str, str], int]) -> None:
    """Every (mode, workload): tok/s against its side's plain decoding, and whether the text stayed the same."""
    modes = sorted({m for m, _ in tps}, key=lambda m: (not m.startswith("magnitude"), "plain" not in m, m))
    print(f"\nmodel {Path(args.model).name}, {args.threads} threads, temperature 0, one slot, "
          f"draft <= {args.draft}; decode tok/s, median of {args.reps} rep(s)")
    print("| workload | mode | tokens | tok/s | vs its own plain | same text as its plain | "
          "same text as magnitude plain |")
    print("|---|---|---:|---:|---:|---|---|")
    for name in args.workloads:
        for mode in modes:
            if (mode, name) not in tps:
                continue
            rate = median(tps[(mode, name)])
            plain = f"{mode.split()[0]} plain"
            base = median(tps.get((plain, name), []))
            same_own = texts[(mode, name)] == texts.get((plain, name))
            same_mag = texts[(mode, name)] == texts.get(("magnitude plain", name))
            print(f"| {name} | {mode} | {tokens[(mode, name)]} | {rate:.1f} | "
                  f"{ratio(rate, base):.2f}x | {'yes' if same_own else 'NO'} | "
                  f"{'yes' if same_mag else 'NO'} |")
    if args.only is None:
        print("\nMagnitude / llama-server (above 1: Magnitude is faster)")
        for name in args.workloads:
            plain = ratio(median(tps[("magnitude plain", name)]), median(tps[("llama-server plain", name)]))
            best_mode = max((m for m in modes if m.startswith("llama-server")),
                            key=lambda m: median(tps[(m, name)]))
            drafting = ratio(median(tps[("magnitude drafting", name)]), median(tps[(best_mode, name)]))
            print(f"  {name:<9} plain {plain:.2f}   drafting vs llama-server's best ({best_mode}) {drafting:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", default=["plain", "echo", "tooljson", "traces"],
                        choices=["plain", "echo", "tooljson", "traces"])
    parser.add_argument("--model", default=str(catalog.get(catalog.DEFAULT_AGENT_MODEL).path()),
                        help="a GGUF with Qwen's chat format (default: the catalog's default agent model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", type=int, default=8, help="most draft tokens per step, both sides")
    parser.add_argument("--server-modes", nargs="*", default=SERVER_MODES,
                        help="llama-server --spec-type values to run beside plain decoding")
    parser.add_argument("--reps", type=int, default=1, help="runs of every workload per mode; medians are printed")
    parser.add_argument("--only", choices=["magnitude", "llama-server"], help="run one side")
    parser.add_argument("--server", help="llama-server binary (default: built/cached by native/build_llama_server.sh)")
    args = parser.parse_args()
    stop_services_on_sigterm()
    if not Path(args.model).is_file():
        sys.exit(f"{args.model} not found (scripts/setup pulls the catalog's models)")

    tps: dict[tuple[str, str], list[float]] = {}  # (mode, workload) -> tok/s per rep
    texts: dict[tuple[str, str], str] = {}  # (mode, workload) -> text of the first rep
    tokens: dict[tuple[str, str], int] = {}

    def record(mode: str, backend, rep: int) -> None:
        for name in args.workloads:
            rate, text, n = run_workload(backend, name, rep)
            print(f"  {mode:<24} {name:<9} {n:>5} tokens {rate:6.1f} tok/s", file=sys.stderr, flush=True)
            tps.setdefault((mode, name), []).append(rate)
            texts.setdefault((mode, name), text)
            tokens.setdefault((mode, name), n)

    with tempfile.TemporaryDirectory(prefix="magdraft", dir="/tmp") as tmp:
        home = Path(tmp)
        binary = None
        if args.only != "magnitude":
            binary = args.server or llama_server.build()
            print("llama-server:", binary, "|", llama_server.version(binary))
        for rep in range(args.reps):
            print(f"rep {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
            sides = [s for s in ("magnitude", "llama-server") if args.only in (None, s)]
            for side in (sides if rep % 2 == 0 else sides[::-1]):  # alternate who goes first
                if side == "magnitude":
                    mag = Magnitude(Path(args.model), home, args.threads, 4096)
                    mag.start(1)
                    try:
                        for draft in ((0, args.draft) if rep % 2 == 0 else (args.draft, 0)):
                            mag.mode(draft)
                            record(f"magnitude {'drafting' if draft else 'plain'}", mag, rep)
                    finally:
                        mag.stop()
                    continue
                for spec in ["none"] + args.server_modes:
                    extra = [] if spec == "none" else ["--spec-type", spec, "--spec-draft-n-max", str(args.draft)]
                    server = ServerBackend(binary, Path(args.model), home, args.threads, 4096, extra)
                    server.start(1)
                    try:
                        record(f"llama-server {'plain' if spec == 'none' else spec}", server, rep)
                    finally:
                        server.stop()

    print_table(args, tps, texts, tokens)
    print("\nreproduce: .venv/bin/python -m scripts.bench.drafting " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
