"""What ``magnitude fleet`` runs on every node, as a one-shot Swarm job in the stack's image: one JSON line out.

The manager sees only Swarm's view (nodes, tasks); how a node's services are doing is known on the node, through
their ipc sockets in its ``run`` volume. So ``fleet.jobs`` starts this module once on each robot node, with that
volume and the stack's configuration mounted, and reads the line each one prints from the service's logs.

    python -m magnitude.fleet.probe status           # every service's health, inference's speed, strategy age
    python -m magnitude.fleet.probe dump             # the optimizer's learned strategy
    python -m magnitude.fleet.probe restore FILE     # make FILE the strategy (validated by the optimizer)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shared.client import Client, ServiceError
from shared.config import SERVICE_NAMES, WATCHDOG_NAME, Config, load_config
from shared.health import probe

#: Starts the one line a probe prints, so the logs' other lines (a warning, a traceback) are never taken for it.
MARKER = "magnitude-fleet-probe "
#: What ``status`` keeps of a service's health reply.
HEALTH_FIELDS = ("uptime_s", "rss_mb", "queue_depth", "running", "model", "restarts")


def _optimizer(config: Config, msg_type: str, body: dict | None = None) -> dict:
    with Client.for_service("optimizer", config, timeout_s=10) as client:
        return client.request(msg_type, body)


def status(config: Config) -> dict[str, Any]:
    """Each service's health; inference's median decode speed and the strategy's age, from the optimizer."""
    services = {}
    for name in (*SERVICE_NAMES, WATCHDOG_NAME):
        found = probe(config, name)
        services[name] = {"healthy": found.healthy, "error": found.error,
                          **{k: found.detail[k] for k in HEALTH_FIELDS if k in found.detail}}
    out: dict[str, Any] = {"services": services, "decode_tps": None, "strategy_age_s": None}
    try:
        optimizer = _optimizer(config, "optimizer.status")
    except ServiceError as err:
        out["optimizer_error"] = f"{err.code}: {err.message}"
        return out
    speeds = [c["decode_tps_p50"] for c in optimizer.get("by_priority", {}).values() if c.get("decode_tps_p50")]
    out["decode_tps"] = max(speeds) if speeds else None
    decisions = optimizer.get("decisions") or []
    out["strategy_age_s"] = round(time.time() - decisions[-1]["ts"], 1) if decisions else None
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m magnitude.fleet.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("status", "dump", "restore"))
    parser.add_argument("file", nargs="?", help="restore: the strategy document")
    args = parser.parse_args(argv)
    config = load_config()
    line: dict[str, Any] = {"node": os.environ.get("NODE_NAME", ""), "what": args.what}
    try:
        if args.what == "status":
            line.update(status(config))
        elif args.what == "dump":
            line["strategy"] = _optimizer(config, "strategy.get")["strategy"]
        else:
            with open(args.file or "") as f:
                line["strategy"] = _optimizer(config, "strategy.set", {"strategy": json.load(f)})["strategy"]
    except (ServiceError, OSError, ValueError) as err:
        line["error"] = str(err)
    print(MARKER + json.dumps(line), flush=True)
    return 1 if "error" in line else 0


if __name__ == "__main__":
    sys.exit(main())
