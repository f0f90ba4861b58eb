"""The optimizer's settings vs fixed defaults on an agent-like mix, side by side in one run (issue 5).

The mix, per round: long-prefill requests (a ~600-token robot log with a small
change at its top, no session, so each one prefills it all) and long-decode
requests (several sessions continuing a log of tool-call JSON lines, ~120
tokens of repetitive output each; their prompt prefix stays cached).

1. Warm-up: inference and optimizer run as processes; the mix runs until the
   optimizer settles (window ``--window`` samples per decision) or ``--warmup-s``.
2. Side by side: the optimizer is stopped (so it cannot move the settings), then
   rounds alternate defaults and the chosen settings (``engine.configure`` between
   rounds; one unmeasured request after each switch), so machine noise hits both.
   Both sides run the same requests in the same order, so each request is paired
   with its twin: it prints the geometric mean and the median of the paired
   latency ratios (the mix's latencies are bimodal, so a median of the pooled
   latencies would jump between the two kinds), per-kind medians, and the chosen
   settings.

    .venv/bin/python -m scripts.bench.optimizer [--window 12] [--warmup-s 540] [--rounds 4]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

from magnitude import launcher
from scripts.bench.common import BENCH_MODEL
from shared import process
from shared.client import Client
from shared.config import dump_config, parse_config

#: ~600 tokens under the Gemma 3 tokenizer (with the report line around it).
LOG = "".join(f"t={i * 1.5:.1f}s lidar front={1.2 + i % 7 * 0.1:.2f}m left={0.8 + i % 5 * 0.1:.2f}m "
              f"battery={97 - i // 3}% motor_temp={41 + i % 4}C state=patrolling\n" for i in range(15))
TOOL_LOG = "Agent log. Each line is one tool call.\n" + "".join(
    f'{{"step": {i}, "tool": "move_to", "args": {{"room": "{room}", "speed": "slow"}}, "status": "ok"}}\n'
    for i, room in enumerate(["kitchen", "hallway", "bedroom", "bathroom", "office", "garage"], 1))


def run_mix(client: Client, round_no: int, sessions: int, tag: str) -> list[float]:
    """One round of the mix; the latency (s) of each request."""
    latencies = []
    for s in range(sessions):
        prompt = f"Patrol report {round_no}-{s}, operator note: check room {round_no % 9}.\n{LOG}Summary:"
        start = time.perf_counter()
        client.generate(prompt, max_tokens=8, temperature=0)
        latencies.append(time.perf_counter() - start)
        start = time.perf_counter()
        client.generate(TOOL_LOG + '{"step": 7,', session_id=f"{tag}-agent-{s}", max_tokens=120, temperature=0)
        latencies.append(time.perf_counter() - start)
    return latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=12, help="engine.optimization_window during warm-up")
    parser.add_argument("--warmup-s", type=float, default=540, help="give up waiting for the optimizer to settle")
    parser.add_argument("--rounds", type=int, default=4, help="side-by-side rounds per setting")
    parser.add_argument("--sessions", type=int, default=3, help="agent sessions (and long prompts) per round")
    args = parser.parse_args()
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))

    with tempfile.TemporaryDirectory(prefix="magopt", dir="/tmp") as tmp:
        config = parse_config({
            "engine": {"model_path": str(BENCH_MODEL), "n_ctx": 2048, "session_slots": args.sessions, "optimization_window": args.window},
            "runtime": {"runtime_dir": f"{tmp}/run", "data_dir": f"{tmp}/data", "queue_size": 8},
            # After a rebuild every session's KV is gone: skip a full round, whose re-prefills are a one-off.
            "optimizer": {"warmup_samples": 1, "rebuild_warmup_samples": 2 * args.sessions, "p99_alert_s": None},
        })
        path = Path(tmp) / "bench.yaml"
        path.write_text(dump_config(config))
        for name in ("inference", "optimizer"):
            status = launcher.start(config, name, str(path), progress=lambda m: print(m, file=sys.stderr))
            if not status.healthy:
                sys.exit(f"{name} did not start: {status.error}")
        client = Client.for_service("inference", config, timeout_s=300)
        optimizer = Client.for_service("optimizer", config, timeout_s=30)
        try:
            defaults = client.health()["settings"]
            deadline, round_no = time.monotonic() + args.warmup_s, 0
            while time.monotonic() < deadline:
                run_mix(client, round_no, args.sessions, "warm")
                round_no += 1
                status = optimizer.request("optimizer.status")
                print(f"warm-up round {round_no}: phase {status['phase']}, trial {status['trial']}, "
                      f"decisions {len(status['decisions'])}", file=sys.stderr, flush=True)
                if status["phase"] == "settled":
                    break
            chosen = status["incumbent"]
            process.stop(config, "optimizer")
            samples: dict[str, list[float]] = {"defaults": [], "optimized": []}
            for r in range(args.rounds):
                order = ("defaults", "optimized") if r % 2 == 0 else ("optimized", "defaults")
                for label in order:
                    client.request("engine.configure", {"settings": defaults if label == "defaults" else chosen})
                    run_mix(client, 1000 + r, 1, f"{label}-{r}-warm")  # after a switch: unmeasured
                    samples[label] += run_mix(client, 1000 + r, args.sessions, f"{label}-{r}")
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        finally:
            client.close()
            optimizer.close()
            for name in ("optimizer", "inference"):
                process.stop(config, name)

    ratios = [o / d for d, o in zip(samples["defaults"], samples["optimized"])]
    geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
    print(f"warm-up: {round_no} rounds, phase {status['phase']}, {len(status['decisions'])} decisions")
    for d in status["decisions"]:
        print(f"  {'kept    ' if d['kept'] else 'reverted'} {d['knob']}: {d['old']} -> {d['new']} "
              f"(gain {d['gain']:+.1%}; {d['reason']})")
    changed = {k: v for k, v in chosen.items() if defaults.get(k) != v}
    print(f"defaults:  {defaults}")
    print(f"chosen:    {changed or 'the defaults'}")
    for kind, index in (("long prefill", 0), ("long decode", 1)):  # run_mix alternates the two kinds
        base, opt = (statistics.median(samples[label][index::2]) for label in ("defaults", "optimized"))
        print(f"median {kind} request: defaults {base:.3f}s, optimized {opt:.3f}s ({opt / base:.3f}x)")
    print(f"paired latency ratio optimized/defaults over {len(ratios)} request pairs: geometric mean "
          f"{geomean:.3f}, median {statistics.median(ratios):.3f} ({'faster' if geomean < 1 else 'not faster'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
