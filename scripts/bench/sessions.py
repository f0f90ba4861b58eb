"""Stateless vs session-bound agent steps on the real model, side by side in one run.

A 10-step agent-like conversation (long system prompt, a growing history of
user turns and model replies) runs four ways against one inference service:

* stateless     - no session id: every step prefills the whole history;
* session       - one session id: each step prefills only its new tokens;
* 4 interleaved - four sessions stepped A, B, C, D, A, B ...; all resident (4 slots);
* 4 on 2 slots  - the same, but only 2 slots: sessions are parked and restored
                  by copying one sequence's KV (llama_state_seq_get/set_data).

It prints TTFT and total time per step and the ratios at the last step.

    .venv/bin/python -m scripts.bench.sessions [--steps 10] [--max-tokens 24]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import msgspec

from scripts.bench.common import start_inference, stop
from scripts.bench.prompts import PLANNER_SYSTEM, PLANNER_TASKS, gemma_prompt
from shared.client import Client

SYSTEM = PLANNER_SYSTEM * 3
TASKS = PLANNER_TASKS[:4]


def conversation_step(history: list[tuple[str, str]], step: int) -> list[tuple[str, str]]:
    note = "Start." if step == 0 else f"Step {step} done: the robot reports success. Continue."
    return history + [("user", note)]


def run(client: Client, sessions: list[str | None], steps: int, max_tokens: int) -> list[list[dict]]:
    """Step every conversation once per round, round-robin; return stats[conversation][step]."""
    histories = [[("user", f"{SYSTEM}\nTask: {TASKS[i % len(TASKS)]}.")] for i in range(len(sessions))]
    stats: list[list[dict]] = [[] for _ in sessions]
    for step in range(steps):
        for i, session in enumerate(sessions):
            if step:
                histories[i] = conversation_step(histories[i], step)
            result = client.generate(gemma_prompt(histories[i]), session, max_tokens=max_tokens, temperature=0)
            histories[i] = histories[i] + [("model", result.text)]
            stats[i].append(msgspec.structs.asdict(result.stats))
    return stats


def median_at(stats: list[list[dict]], step: int, key: str) -> float:
    """Median over a mode's conversations: robust to a noisy neighbour on a shared machine."""
    return statistics.median(conv[step][key] for conv in stats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--n-ctx", type=int, default=4096)
    args = parser.parse_args()

    results = {}
    with tempfile.TemporaryDirectory(prefix="magb", dir="/tmp") as tmp:
        for slots, modes in ((4, {"stateless": [None], "session": ["solo"],
                                  "4 interleaved": ["a", "b", "c", "d"]}),
                             (2, {"4 on 2 slots": ["pa", "pb", "pc", "pd"]})):
            config, client = start_inference(Path(tmp), str(slots), {"session_slots": slots, "n_ctx": args.n_ctx})
            try:
                client.generate("warm up", None, max_tokens=1)
                for mode, sessions in modes.items():
                    print(f"running {mode} ({len(sessions)} conversation(s) x {args.steps} steps) ...",
                          file=sys.stderr, flush=True)
                    results[mode] = run(client, sessions, args.steps, args.max_tokens)
            finally:
                stop(config, client)

    modes = list(results)
    print(f"\nTTFT (s) and total (s) per step; median over each mode's conversations; "
          f"max_tokens={args.max_tokens}, temperature 0")
    header = f"{'step':>4} {'prompt':>6} " + " ".join(f"{m + ' ttft':>18} {'total':>6}" for m in modes)
    print(header)
    for step in range(args.steps):
        row = f"{step + 1:>4} {results['stateless'][0][step]['prompt_tokens']:>6} "
        row += " ".join(f"{median_at(results[m], step, 'ttft_s'):>18.3f} {median_at(results[m], step, 'total_s'):>6.2f}"
                        for m in modes)
        print(row)
    last = args.steps - 1
    base = median_at(results["stateless"], last, "ttft_s")
    print(f"\nat step {args.steps}: stateless TTFT {base:.3f}s")
    for mode in modes[1:]:
        ttft = median_at(results[mode], last, "ttft_s")
        cached = median_at(results[mode], last, "cached_tokens")
        prefill = median_at(results[mode], last, "prefill_tokens")
        switch = statistics.median(s["kv_switch_ms"] for conv in results[mode] for s in conv[1:])
        print(f"  {mode:<14} TTFT {ttft:.3f}s  -> {base / ttft:5.1f}x lower than stateless "
              f"(cached {cached:.0f} tokens, prefilled {prefill:.0f}; median slot switch {switch:.1f} ms)")
    restored = sum(s["kv_source"] == "restored" for conv in results["4 on 2 slots"] for s in conv)
    print(f"  '4 on 2 slots' restored a parked session {restored} times")
    print("\nreproduce: .venv/bin/python -m scripts.bench.sessions " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
