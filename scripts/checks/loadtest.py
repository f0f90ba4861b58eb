"""Load and soak the inference service over ZeroMQ on this machine (ipc or loopback only).

Load: for each N in --clients (default 1 4 16 64), N concurrent clients, each on
its own socket, send a bounded number of short generate requests; every request
must end in a final reply. The service batches up to --slots generations per
decode step (--slots 1 shows the unbatched service). The table shows throughput, p50/p99 latency of the
answered ones, and errors by code: with a bounded queue, overload shows up as
``busy`` replies (back-pressure), never as lost requests.

Soak (--soak SECONDS): 4 clients keep the service busy for that long (bounded);
the RSS of every running service is sampled; the run fails if memory keeps
growing in the second half or any request is lost.

    .venv/bin/python -m scripts.checks.loadtest                 # starts its own inference service
    .venv/bin/python -m scripts.checks.loadtest --soak 600      # 10-minute soak
    .venv/bin/python -m scripts.checks.loadtest --running       # against the stack of `magnitude up`
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from magnitude import launcher
from scripts.bench.common import BENCH_MODEL
from scripts.bench.stats import pct
from shared import process
from shared.health import probe
from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, Config, dump_config, load_config, parse_config

PROMPTS = ["Name a color.", "Say hi to the robot.", "One word for fast:", "Count to three:"]


class Tally:
    """Outcomes of every request, shared by the client threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.codes: Counter[str] = Counter()
        self.latencies: list[float] = []

    def record(self, code: str, latency: float) -> None:
        with self.lock:
            self.codes[code] += 1
            if code == "ok":
                self.latencies.append(latency)


def client_loop(config: Config, tally: Tally, requests: int | None, until: float | None, max_tokens: int) -> None:
    """Send requests one after another: ``requests`` of them, or until the monotonic time ``until``."""
    client = Client.for_service("inference", config, timeout_s=120)
    sent = 0
    try:
        while (requests is None or sent < requests) and (until is None or time.monotonic() < until):
            t0 = time.perf_counter()
            try:
                client.generate(PROMPTS[sent % len(PROMPTS)], max_tokens=max_tokens, temperature=0)
                code = "ok"
            except ServiceError as err:
                code = "lost" if err.code in ("timeout", "unavailable") else err.code
            tally.record(code, time.perf_counter() - t0)
            sent += 1
            if code == "busy":
                time.sleep(0.05)  # back off, as a well-behaved client does
    finally:
        client.close()


def run_level(config: Config, tally: Tally, n: int, per_client: int | None, until: float | None,
              max_tokens: int) -> float:
    """Run ``n`` client threads to completion; return the wall time."""
    threads = [threading.Thread(target=client_loop, args=(config, tally, per_client, until, max_tokens))
               for _ in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def rss_of_services(config: Config) -> dict[str, float]:
    out = {}
    for name in SERVICE_NAMES:
        status = probe(config, name, timeout_s=5)
        if status.healthy:
            out[name] = status.detail["rss_mb"]
    return out


def load(config: Config, levels: list[int], total: int, max_tokens: int) -> int:
    print(f"{'clients':>7} {'sent':>5} {'ok':>5} {'busy':>5} {'other':>5} {'lost':>5} {'ok/s':>6} "
          f"{'p50 s':>6} {'p99 s':>6} {'rss MB':>7}")
    failed = False
    for n in levels:
        per_client = max(2, total // n)
        tally = Tally()
        wall = run_level(config, tally, n, per_client, None, max_tokens)
        codes = tally.codes
        other = sum(v for k, v in codes.items() if k not in ("ok", "busy", "lost"))
        failed |= bool(other or codes["lost"])
        rss = rss_of_services(config).get("inference", float("nan"))
        print(f"{n:>7} {sum(codes.values()):>5} {codes['ok']:>5} {codes['busy']:>5} {other:>5} {codes['lost']:>5} "
              f"{codes['ok'] / wall:>6.2f} {pct(tally.latencies, 50):>6.2f} {pct(tally.latencies, 99):>6.2f} "
              f"{rss:>7.1f}", flush=True)
        if other:
            print(f"        unexpected error codes: {dict(codes)}")
    print("\nzero lost requests; errors only 'busy'" if not failed else "\nFAILED: lost requests or non-busy errors")
    return 1 if failed else 0


def soak(config: Config, seconds: float, max_tokens: int, sample_s: float) -> int:
    tally = Tally()
    until = time.monotonic() + seconds
    runner = threading.Thread(target=run_level, args=(config, tally, 4, None, until, max_tokens))
    runner.start()
    samples = []
    t0 = time.monotonic()
    names = list(rss_of_services(config))  # the services that are running
    print(f"{'t s':>6} " + " ".join(f"{n + ' MB':>14}" for n in names))
    while runner.is_alive():
        rss = rss_of_services(config)
        samples.append(rss)
        print(f"{time.monotonic() - t0:>6.0f} " + " ".join(f"{rss.get(n, float('nan')):>14.1f}" for n in names),
              flush=True)
        runner.join(timeout=sample_s)
    half = samples[len(samples) // 2:]
    growth = {n: max(s.get(n, 0) for s in half) - half[0].get(n, 0) for n in half[0]} if half else {}
    codes = tally.codes
    print(f"\nrequests: {dict(codes)}; p50 {pct(tally.latencies, 50):.2f}s p99 {pct(tally.latencies, 99):.2f}s; "
          f"RSS growth over the second half (MB): {growth}")
    bad = [n for n, g in growth.items() if g > max(32.0, 0.05 * half[0][n])]
    lost = codes["lost"] + sum(v for k, v in codes.items() if k not in ("ok", "busy", "lost"))
    if bad or lost:
        print(f"FAILED: memory still growing in {bad}; {lost} requests lost or failed")
        return 1
    print("memory flat, nothing lost")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--requests", type=int, default=32, help="requests per level, spread over its clients")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--queue-size", type=int, default=32, help="queue of the service this script starts")
    parser.add_argument("--slots", type=int, default=4,
                        help="session slots of the service this script starts = generations batched per step")
    parser.add_argument("--soak", type=float, metavar="SECONDS", help="soak instead of the load table")
    parser.add_argument("--sample", type=float, default=10.0, help="soak: seconds between RSS samples")
    parser.add_argument("--running", action="store_true", help="use the running stack ($MAGNITUDE_CONFIG)")
    args = parser.parse_args()

    if args.running:
        config = load_config()
        return soak(config, args.soak, args.max_tokens, args.sample) if args.soak else \
            load(config, args.clients, args.requests, args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="magl", dir="/tmp") as tmp:
        config = parse_config({"engine": {"model_path": str(BENCH_MODEL), "session_slots": args.slots},
                               "runtime": {"runtime_dir": f"{tmp}/run", "queue_size": args.queue_size}})
        path = Path(tmp) / "load.yaml"
        path.write_text(dump_config(config))
        status = launcher.start(config, "inference", str(path), progress=lambda m: print(m, file=sys.stderr))
        if not status.healthy:
            sys.exit(f"inference did not start: {status.error}")
        try:
            print(f"inference service, slots={args.slots}, queue_size={args.queue_size}, "
                  f"max_tokens={args.max_tokens}\n")
            code = soak(config, args.soak, args.max_tokens, args.sample) if args.soak else \
                load(config, args.clients, args.requests, args.max_tokens)
        finally:
            process.stop(config, "inference")
    print("reproduce: .venv/bin/python -m scripts.checks.loadtest " + " ".join(sys.argv[1:]))
    return code


if __name__ == "__main__":
    sys.exit(main())
