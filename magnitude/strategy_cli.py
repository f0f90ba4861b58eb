"""``magnitude strategy show|dump|restore``: the optimizer's learned strategy.

Talks to the running optimizer service; when it is down, says so and exits 1.
"""

from __future__ import annotations

import argparse
import json
import sys

from shared.client import Client, ServiceError


def _ask(config, args, msg_type: str, body: dict | None = None) -> dict | None:
    try:
        with Client.for_service("optimizer", config, timeout_s=args.timeout) as client:
            return client.request(msg_type, body)
    except ServiceError as err:
        hint = " (is the stack running? start it with `magnitude up`)" if err.code in ("unavailable", "timeout") else ""
        print(f"error: optimizer: {err}{hint}", file=sys.stderr)
        return None


def cmd_show(args, config) -> int:
    status = _ask(config, args, "optimizer.status")
    if status is None:
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    trial = status["trial"]
    print(f"phase        {status['phase']}   load class: {status['load_class'] or '-'}   "
          f"window: {status['window_fill']}/{status['window_size']}")
    print(f"trial        {trial['knob']} = {trial['value']}" if trial else "trial        -")
    print(f"learned      {json.dumps(status['incumbent'], sort_keys=True)}")
    print(f"engine runs  {status['settings_id'] or '-'}   overrides: {json.dumps(status['overrides'])}")
    thermal = status.get("thermal") or {}
    print(f"thermal      relief level {status['relief_level']}   temp {thermal.get('max_temp_c')} C   "
          f"clock {thermal.get('freq_ratio')} of max")
    decisions = status["decisions"]
    print(f"decisions    {len(decisions)}" + (" (last 5):" if decisions else ""))
    for d in decisions[-5:]:
        print(f"  {'kept    ' if d['kept'] else 'reverted'} {d['knob']}: {d['old']} -> {d['new']}  "
              f"gain {d['gain']:+.1%}  ({d['reason']})")
    return 0


def cmd_dump(args, config) -> int:
    reply = _ask(config, args, "strategy.get")
    if reply is None:
        return 1
    text = json.dumps(reply["strategy"], indent=2) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"strategy written to {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


def cmd_restore(args, config) -> int:
    try:
        with open(args.file) as f:
            document = json.load(f)
    except (OSError, ValueError) as exc:
        print(f"error: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    reply = _ask(config, args, "strategy.set", {"strategy": document})
    if reply is None:
        return 1
    print(f"restored: {json.dumps(reply['strategy']['settings'], sort_keys=True)} (saved to {reply['path']})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    strategy = sub.add_parser("strategy", help="the optimizer's learned strategy: show, dump, restore",
                              description="Show, dump or restore the strategy the optimizer learned "
                                          "(the running optimizer service answers).")
    ssub = strategy.add_subparsers(dest="strategy_command", required=True)
    p = ssub.add_parser("show", help="phase, load class, trial, learned settings, recent decisions")
    p.add_argument("--json", action="store_true", help="the full optimizer.status reply")
    p.set_defaults(fn=cmd_show)
    p = ssub.add_parser("dump", help="print the strategy document (JSON)")
    p.add_argument("--out", metavar="FILE", help="write it to FILE instead of stdout")
    p.set_defaults(fn=cmd_dump)
    p = ssub.add_parser("restore", help="validate a dumped strategy, make it current and push it to inference")
    p.add_argument("file", metavar="FILE")
    p.set_defaults(fn=cmd_restore)
    for p in ssub.choices.values():
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the optimizer")
