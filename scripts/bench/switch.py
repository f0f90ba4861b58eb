"""Model slots: alternating requests between two resident models vs a reload per request, in one run.

Two inference services run side by side with the same two named models
("chat" and "fast"; both are the bundled Gemma 3 270M file unless --fast-model
names another GGUF):

* resident - ``engine.max_models: 2``: both stay loaded, a request names its
             model and runs on that model's own context, no reload;
* reload   - ``engine.max_models: 1``: every switch unloads one model and loads
             the other (weights mapped again, a new context allocated).

Requests alternate chat, fast, chat, ... and the two services take turns
round by round, so machine noise hits both. It prints the median switch
latency (``model_load_ms`` as the service reports it) and the median end-to-end
request latency of each, and their ratio.

    .venv/bin/python -m scripts.bench.switch [--rounds 10] [--max-tokens 16] [--fast-model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.common import start_inference, stop
from shared import catalog

PROMPT = "Robot status report. Battery: 81%. Location: kitchen. Next action:"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="chat+fast request pairs per mode")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--fast-model", type=Path, default=catalog.get(catalog.BASE_MODEL).path(),
                        help="GGUF of the second model (default: the bundled one under a second name)")
    args = parser.parse_args()

    # model_load_interval_s 0: this benchmark measures reloads on purpose (the service bounds them by default)
    engine = {"n_ctx": 1024, "session_slots": 1, "model_load_interval_s": 0, "models": {"chat": str(catalog.get(catalog.BASE_MODEL).path()),
                                                              "fast": str(args.fast_model)}}
    modes = {"resident": {**engine, "max_models": 2}, "reload": {**engine, "max_models": 1}}
    stats: dict[str, list[dict]] = {mode: [] for mode in modes}
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory(prefix="magsw", dir="/tmp") as tmp:
        services = {mode: start_inference(Path(tmp), mode, cfg) for mode, cfg in modes.items()}
        try:
            for config, client in services.values():
                client.request("model.unload", {"name": "default"})  # only chat and fast take slots
                for name in ("chat", "fast"):
                    client.generate("warm up", max_tokens=1, model=name)
            for rnd in range(args.rounds):
                for mode, (_, client) in services.items():
                    for name in ("chat", "fast"):
                        t0 = time.perf_counter()
                        result = client.generate(PROMPT, max_tokens=args.max_tokens, temperature=0, model=name)
                        wall[mode].append(time.perf_counter() - t0)
                        stats[mode].append(result.stats)
                print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)
            loads = {mode: client.health()["model_loads"] for mode, (_, client) in services.items()}
        finally:
            for config, client in services.values():
                stop(config, client)

    print(f"\n{args.rounds * 2} requests per mode, alternating chat/fast, max_tokens={args.max_tokens}")
    print(f"{'mode':<9} {'switch ms (median)':>19} {'request s (median)':>19} {'models loaded':>14}")
    for mode in modes:
        switch = statistics.median(s["model_load_ms"] for s in stats[mode])
        print(f"{mode:<9} {switch:>19.1f} {statistics.median(wall[mode]):>19.3f} {loads[mode]:>14}")
    ratio = statistics.median(wall["reload"]) / statistics.median(wall["resident"])
    print(f"\nend to end: a reload per request is {ratio:.2f}x slower than switching between resident models")
    print("reproduce: .venv/bin/python -m scripts.bench.switch " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
