"""BFCL v4 multi_turn_base through Magnitude's ``/v1/responses``, a plain chat-completions loop on its gateway,
and the same loop on llama-server: one model, scored by BFCL's official multi-turn checker.

The data, the function docs, the simulated APIs (file system, vehicle control, trading, travel, messaging,
tickets, math, ...) and the checker come from the pinned ``bfcl-eval`` wheel, unpacked and never installed
(scripts/provision/bfcl.py; fetched here on first use). Each case is a conversation of one to seven user
turns; every call a system makes runs on that case's own instances of the APIs, and the official
``multi_turn_checker`` replays each system's calls turn by turn beside the ground truth's and compares the APIs'
state after each turn and the calls' outputs. A case passes only when every turn does.

Systems (``--systems``; scripts/bench/bfcl/systems.py says exactly what each sends):
  responses  the gateway's ``POST /v1/responses``, the case's functions as caller tools; later turns go on
             with ``previous_response_id`` (the conversation and its warm session)
  chat       the official ``openai`` client's tool loop on the gateway's ``/v1/chat/completions``
  peer       the same loop on ``llama-server --jinja`` (native/build_llama_server.sh)
Same model, temperature 0, seed 0, the same step cap per turn and tokens per step, the same n_ctx and threads.
The chat loop sends ``X-Session-Id`` per case (docs/gateway.md: a session keeps the case's KV warm between
steps; the reply is the one without it), as llama-server's single slot keeps its own prompt cache.
The whole run holds the shared heavy-job lock (/tmp/magnitude-heavy.lock), as scripts/bench/agent does.

Needs the ``bench`` extra (the pinned ``openai`` client).

    .venv/bin/python -m scripts.bench.bfcl --limit 10
    .venv/bin/python -m scripts.bench.bfcl --spread 10          # cases 0, 20, ..., 180: every API group
    .venv/bin/python -m scripts.bench.bfcl --systems responses,chat --limit 3 --json /tmp/bfcl.json
    .venv/bin/python -m scripts.bench.bfcl --model /path/to/other.gguf --cases multi_turn_base_7,multi_turn_base_9
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from magnitude import launcher
from scripts.bench import llama_server
from scripts.bench.agent.__main__ import HEAVY_LOCK, heavy_lock
from scripts.bench.bfcl import official
from scripts.bench.bfcl.systems import SYSTEMS, Record, ResponsesClient, progress, run_chat, run_responses, score
from scripts.bench.common import stop_services_on_sigterm
from scripts.provision import bfcl as provision
from shared import catalog, process
from shared.client import Client
from shared.config import Config, dump_config, parse_config


def stack_config(home: Path, model_path: Path, args) -> Config:
    """inference, tools and the gateway: no configured tools (a case's functions are the only ones offered),
    no memory recall (no retrieval service runs), the step cap and tokens per step of the chat loops."""
    return parse_config({
        "engine": {"model_path": str(model_path), "n_ctx": args.n_ctx, "session_slots": 2, "self_optimize": False,
                   "n_threads": args.threads},
        "agent": {"tools": [], "max_iterations": args.max_steps, "max_step_tokens": args.max_tokens,
                  "recall_k": 0},
        "gateway": {"port": 0, "allow_keyless_loopback": True, "request_timeout_s": args.timeout,
                    "max_body_bytes": 8 << 20},
        "runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")},
        "metrics": {"enabled": False}, "watchdog": {"enabled": False},
    })


def _run(name: str, cases: list[official.Case], one) -> list[Record]:
    records = []
    for i, case in enumerate(cases, 1):
        record = score(case, one(case))
        records.append(record)
        progress(i, len(cases), record)
    print(f"{name}: {sum(r.ok for r in records)}/{len(records)}", file=sys.stderr, flush=True)
    return records


def run_magnitude(config: Config, home: Path, cases: list[official.Case], args) -> dict[str, list[Record]]:
    import openai
    path = home / "stack.yaml"
    path.write_text(dump_config(config))
    results: dict[str, list[Record]] = {}
    names = ("inference", "tools", "gateway")
    try:
        for name in names:
            status = launcher.start(config, name, str(path), wait_s=300,
                                    progress=lambda m: print(m, file=sys.stderr))
            if not status.healthy:
                raise SystemExit(f"{name} did not start: {status.error}")
        with Client.for_service("gateway", config, timeout_s=10) as gateway:
            url = gateway.health()["url"]
        if "responses" in args.systems:
            client = ResponsesClient(url, None, args.timeout)
            results["responses"] = _run("responses", cases, lambda c: run_responses(client, c, 4 * args.max_steps))
        if "chat" in args.systems:
            chat = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=args.timeout, max_retries=0)
            results["chat"] = _run("chat", cases, lambda c: run_chat(
                chat, "chat", "default", c, args.max_steps, args.max_tokens,
                extra_headers={"X-Session-Id": f"bfcl-{c.id}"}))
    finally:
        for name in reversed(names):
            process.stop(config, name)
    return results


def run_peer(binary: str, model_path: Path, home: Path, cases: list[official.Case], args) -> list[Record]:
    import openai
    with llama_server.LlamaServer(binary, model_path, ["--jinja", "-c", str(args.n_ctx), "-np", "1",
                                                       "-t", str(args.threads or os.cpu_count() or 1)],
                                  home / "llama-server.log") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=args.timeout, max_retries=0)
        return _run("peer", cases, lambda c: run_chat(client, "peer", "local", c, args.max_steps, args.max_tokens))


def summary(records: list[Record]) -> dict:
    n = len(records) or 1
    return {"passed": sum(r.ok for r in records), "cases": len(records),
            "accuracy": sum(r.ok for r in records) / n, "seconds_per_case": sum(r.seconds for r in records) / n,
            "steps_per_case": sum(r.steps for r in records) / n,
            "turns_passed": sum(r.turns_ok for r in records), "turns": sum(r.n_turns for r in records),
            "errors": sum(r.error is not None for r in records)}


def which(ids: list[str]) -> str:
    """The cases run, in a few words: "the first 10", or their numbers."""
    numbers = [int(i.rsplit("_", 1)[1]) for i in ids]
    if numbers == list(range(len(numbers))):
        return f"the first {len(numbers)}"
    return "numbers " + ",".join(map(str, numbers))


def print_table(results: dict[str, list[Record]], model: str, version: str | None, ids: list[str], args) -> None:
    n = len(ids)
    print(f"\nBFCL v4 {official.CATEGORY}: {n} of 200 cases ({which(ids)}), model {model}, max {args.max_steps} steps of "
          f"{args.max_tokens} tokens per turn, n_ctx {args.n_ctx}, temperature 0; scored by bfcl-eval "
          f"{provision.VERSION}'s multi_turn_checker")
    if version:
        print(f"peer: llama-server --jinja ({version}) + openai {__import__('openai').__version__} loop")
    print(f"{'system':<11}{'passed':>9}{'accuracy':>10}{'s/case':>9}{'steps/case':>12}{'errors':>8}"
          f"{'turns passed':>14}")
    sums = {s: summary(r) for s, r in results.items()}
    for system, s in sums.items():
        print(f"{system:<11}{str(s['passed']) + '/' + str(s['cases']):>9}{100 * s['accuracy']:>9.1f}%"
              f"{s['seconds_per_case']:>9.1f}{s['steps_per_case']:>12.1f}{s['errors']:>8}"
              f"{str(s['turns_passed']) + '/' + str(s['turns']):>14}")
    if "responses" in sums:
        for other in ("chat", "peer"):
            if other in sums:
                a, b = sums["responses"]["accuracy"], sums[other]["accuracy"]
                ratio = f"{a / b:.2f}" if b else ("inf" if a else "n/a (both 0)")
                print(f"responses/{other}: accuracy x{ratio}, time per case "
                      f"x{sums['responses']['seconds_per_case'] / max(sums[other]['seconds_per_case'], 1e-9):.2f}")
    if "responses" in results:
        print("responses: later turns continue with previous_response_id (the gateway's conversation "
              "continuation), not a re-sent transcript")
    print("turns passed: the leading turns of each case the official checker passes (it stops at a case's first "
          "failing turn), summed")


def rescore(args, cases: list[official.Case]) -> int:
    saved = json.loads(args.rescore.read_text())
    by_id = {c.id: c for c in cases}
    results = {system: [score(by_id[r["case"]], Record.from_dict(r)) for r in records]
               for system, records in saved["cases"].items()}
    ids = [r.case for r in next(iter(results.values()), [])]
    print_table(results, saved["model"], saved.get("llama_server"), ids, args)
    if args.json:
        write_json(args.json, saved["model"], saved.get("llama_server"), results)
    return 0


def write_json(path: Path, model: str, version: str | None, results: dict[str, list[Record]]) -> None:
    path.write_text(json.dumps({"model": model, "llama_server": version, "summary": {
        s: summary(r) for s, r in results.items()}, "cases": {s: [r.to_dict() for r in rs]
                                                             for s, rs in results.items()}}, indent=1))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.bfcl", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, help="run only the first N cases (of 200)")
    parser.add_argument("--cases", help="comma-separated case ids (e.g. multi_turn_base_7) instead of the first N")
    parser.add_argument("--spread", type=int, metavar="N",
                        help="N cases evenly spaced over the set (0, 200/N, ...): the set is grouped by API (file "
                             "system, vehicle, trading, travel, in blocks of 50), so the first N see one or two")
    parser.add_argument("--systems", default=",".join(SYSTEMS),
                        help=f"which of {', '.join(SYSTEMS)} to run, comma-separated (default: all)")
    parser.add_argument("--model", default=catalog.DEFAULT_AGENT_MODEL,
                        help=f"a catalog name or a GGUF path (default: {catalog.DEFAULT_AGENT_MODEL})")
    parser.add_argument("--max-steps", type=int, default=8, help="model steps per turn, every system (default 8)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per model step (default 256)")
    parser.add_argument("--n-ctx", type=int, default=16384,
                        help="context size, every system (default 16384: a case's function docs are up to ~5k "
                             "tokens, and up to seven turns of calls and outputs follow)")
    parser.add_argument("--threads", type=int, default=0, help="threads, both engines (0: Magnitude's default, "
                                                               "llama-server: one per CPU)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds one request may take (default 1800)")
    parser.add_argument("--json", type=Path, help="write every case's record (calls, answers, verdict) here")
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {HEAVY_LOCK} (already held)")
    parser.add_argument("--rescore", type=Path, metavar="JSON",
                        help="run no model: score the calls a --json file recorded again and print its table")
    args = parser.parse_args()
    args.systems = [s for s in args.systems.split(",") if s]
    if unknown := set(args.systems) - set(SYSTEMS):
        parser.error(f"unknown systems {', '.join(sorted(unknown))}: --systems takes {', '.join(SYSTEMS)}")
    stop_services_on_sigterm()
    if args.model.endswith(".gguf"):
        model_name, model_path = Path(args.model).stem, Path(args.model)
    else:
        try:
            model_name, model_path = args.model, catalog.get(args.model).path()
        except catalog.CatalogError as err:
            raise SystemExit(str(err)) from None
    if not model_path.is_file():
        raise SystemExit(f"no model at {model_path}: run `magnitude models pull {args.model}`")
    try:
        root = provision.ensure(say=lambda m: print(m, file=sys.stderr))
    except provision.ProvisionError as err:
        raise SystemExit(f"bfcl: {err}") from None
    cases = official.load_cases(root)
    if args.rescore:
        return rescore(args, cases)
    if args.cases:
        wanted = args.cases.split(",")
        by_id = {c.id: c for c in cases}
        if missing := [w for w in wanted if w not in by_id]:
            parser.error(f"no such cases: {', '.join(missing)}")
        cases = [by_id[w] for w in wanted]
    if args.spread:
        cases = cases[::max(len(cases) // args.spread, 1)][:args.spread]
    cases = cases[:args.limit]
    binary = llama_server.build() if "peer" in args.systems else None
    version = llama_server.version(binary) if binary else None
    results: dict[str, list[Record]] = {}
    with tempfile.TemporaryDirectory(prefix="mbfcl", dir="/tmp") as tmp, heavy_lock(not args.no_lock):
        home = Path(tmp)
        print(f"bfcl: {len(cases)} cases, systems {', '.join(args.systems)}", file=sys.stderr, flush=True)
        if {"responses", "chat"} & set(args.systems):
            results.update(run_magnitude(stack_config(home, model_path, args), home, cases, args))
        if binary is not None:
            results["peer"] = run_peer(binary, model_path, home, cases, args)
    results = {s: results[s] for s in SYSTEMS if s in results}
    print_table(results, model_name, version, [c.id for c in cases], args)
    if args.json:
        write_json(args.json, model_name, version, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
