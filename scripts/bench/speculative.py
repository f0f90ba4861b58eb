"""Speculative decoding (prompt-lookup drafting) on agent-like output, on vs off, side by side in one run.

Agent output repeats what the context holds: tool-call JSON in a fixed shape, code
echoed back with a small change, file paths and ids from earlier observations.
Prompt-lookup drafting proposes the tokens that followed the latest n-gram the last
time it occurred; the model checks every draft in the same decode step, so each
correct draft is a token without a decode step of its own.

Each workload runs with drafting off and on, alternating per repetition on one
service (``engine.configure`` switches it between runs, a hot setting), at
temperature 0, so the texts must be identical. It prints decode tokens/s, the
ratio, and how many drafts were accepted.

    .venv/bin/python -m scripts.bench.speculative [--reps 3] [--draft 8] [--max-tokens 160]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from scripts.bench.common import start_inference, stop

TOOL_JSON = "Agent log. Each line is one tool call.\n" + "".join(
    f'{{"step": {i}, "tool": "move_to", "args": {{"room": "{room}", "speed": "slow"}}, "why": "check the {room}"}}\n'
    for i, room in enumerate(["kitchen", "hallway", "bedroom", "bathroom", "office", "garage"], 1))
CODE = '''Original:
def plan_route(rooms, start):
    """Visit every room once, nearest first."""
    route = [start]
    remaining = [r for r in rooms if r != start]
    while remaining:
        here = route[-1]
        nearest = min(remaining, key=lambda r: distance(here, r))
        route.append(nearest)
        remaining.remove(nearest)
    return route

Copy of the same function, unchanged:
def plan_route(rooms, start):
'''
WORKLOADS = {"tool-call JSON": TOOL_JSON, "echoed code": CODE}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="runs per workload and mode (median reported)")
    parser.add_argument("--draft", type=int, default=8, help="spec_draft_tokens when drafting is on")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="magspec", dir="/tmp") as tmp:
        config, client = start_inference(Path(tmp), "spec", {"n_ctx": 2048, "session_slots": 1})
        try:
            client.generate("warm up", max_tokens=4)
            for name, prompt in WORKLOADS.items():
                runs = {0: [], args.draft: []}
                for rep in range(args.reps):
                    for draft in runs:
                        client.request("engine.configure", {"settings": {"spec_draft_tokens": draft}})
                        result = client.generate(prompt, max_tokens=args.max_tokens, temperature=0)
                        runs[draft].append(result)
                        print(f"{name}: rep {rep + 1}, draft {draft}: {result.stats.decode_tps} tok/s",
                              file=sys.stderr, flush=True)
                off, on = runs[0], runs[args.draft]
                same = all(r.text == off[0].text for r in off + on)
                tps_off = statistics.median(r.stats.decode_tps for r in off)
                tps_on = statistics.median(r.stats.decode_tps for r in on)
                accepted = sum(r.stats.accepted_tokens for r in on)
                drafted = sum(r.stats.draft_tokens for r in on)
                tokens = on[0].stats.completion_tokens
                rows.append((name, tokens, tps_off, tps_on, accepted, drafted, same))
        finally:
            stop(config, client)

    print(f"\ndecode tokens/s, median of {args.reps} runs each, temperature 0, spec_draft_tokens={args.draft}")
    print(f"{'workload':<16} {'tokens':>6} {'off':>8} {'on':>8} {'speed-up':>9} {'drafts accepted':>16} {'same text':>9}")
    for name, tokens, off, on, accepted, drafted, same in rows:
        share = f"{accepted}/{drafted}"
        print(f"{name:<16} {tokens:>6} {off:>8.1f} {on:>8.1f} {on / off:>8.2f}x {share:>16} {str(same):>9}")
    print("\nreproduce: .venv/bin/python -m scripts.bench.speculative " + " ".join(sys.argv[1:]))
    return 0 if all(row[-1] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
