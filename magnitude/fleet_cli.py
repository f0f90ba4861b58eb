"""``magnitude fleet``: the stack on Docker Swarm, seen and tuned from a manager (docs/fleet.md).

``stack`` writes the Swarm stack file generated from compose.yaml (``magnitude.fleet.stack``); ``status`` and
``strategy dump|restore`` act on the nodes through one-shot probes beside the stack's services
(``magnitude.fleet.jobs``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from magnitude.fleet import jobs
from magnitude.fleet.stack import (API_KEYS_SECRET, CLIENT_SECRETS, CURVE_CLIENT, ROLE_LABEL, SERVER_SECRETS,
                                   write_stack)

REPO = Path(__file__).resolve().parent.parent
#: The node label that names a box's board (``rk3588``, ``jetson-orin``...): strategies are pushed per board kind.
BOARD_LABEL = "magnitude.board"
STRATEGY_PATH = "/etc/magnitude/strategy.json"


def cmd_stack(args, config) -> int:
    placement = {side: constraint for side, constraint in (("robot", args.robot_constraint),
                                                           ("inference", args.inference_constraint)) if constraint}
    stack_file = write_stack(Path(args.compose), Path(args.image_config), Path(args.out), args.inference_node,
                             placement)
    print(f"wrote {stack_file} and its configuration (magnitude*.yaml) in {stack_file.parent}")
    print("deploy, on a manager of the swarm:")
    print(f"  docker node update --label-add {ROLE_LABEL}=robot NODE      # each robot's box")
    if args.inference_node:
        print(f"  docker node update --label-add {ROLE_LABEL}=inference NODE  # the box that runs the model")
        print(f"  scripts/ops/keys init --client {CURVE_CLIENT}   # CURVE keys, in $MAGNITUDE_HOME/data/keys")
        for secret, path in {**CLIENT_SECRETS, **SERVER_SECRETS}.items():
            print(f"  docker secret create {secret} $MAGNITUDE_HOME/data/keys/{path}")
    print(f"  docker secret create {API_KEYS_SECRET} KEYS_FILE            # scripts/ops/keys api-key NAME makes one")
    print(f"  docker stack deploy --resolve-image never -c {stack_file} magnitude")
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr)


def fleet_status(client: Any, stack: str) -> dict[str, Any]:
    """Swarm's view of every node, with the health of each service placed there, as a probe beside it found it."""
    nodes = jobs.swarm_view(client, stack)
    for beside, names in jobs.placement_groups(client, stack):
        for found in jobs.run_probe(client, stack, ["status"], beside=beside, progress=_progress):
            node = nodes.setdefault(found["node"], {"tasks": {}})
            node.update({k: v for k, v in found.items() if k not in ("node", "what", "services") and v is not None})
            services = node.setdefault("services", {})
            for name in names:
                if name in found.get("services", {}):
                    services[name] = {"task": node["tasks"].get(name), **found["services"][name]}
    for node in nodes.values():
        services = node.setdefault("services", {})
        for name, state in node.pop("tasks").items():
            services.setdefault(name, {"task": state, "healthy": None})
        node.setdefault("decode_tps", None)
        node.setdefault("strategy_age_s", None)
    return {"stack": stack, "nodes": nodes}


def _print_status(status: dict[str, Any]) -> None:
    print(f"{'node':<16} {'service':<10} {'task':<9} {'health':<10} {'queue':>5} {'tok/s':>6} "
          f"{'strategy age':>12}  model")
    for hostname, node in sorted(status["nodes"].items()):
        if not node["services"]:
            print(f"{hostname:<16} (role {node.get('role') or '-'}, {node.get('state')}: runs none of the stack)")
            continue
        tps, age = node["decode_tps"], node["strategy_age_s"]
        for name, svc in node["services"].items():
            health = {True: "healthy", False: "UNHEALTHY", None: "unknown"}[svc.get("healthy")]
            print(f"{hostname:<16} {name:<10} {svc.get('task') or '-':<9} {health:<10} "
                  f"{svc.get('queue_depth', '-'):>5} {(f'{tps:.1f}' if tps and name == 'inference' else '-'):>6} "
                  f"{(f'{age:.0f} s' if age is not None and name == 'optimizer' else '-'):>12}  "
                  f"{svc.get('model') or ''}{'  ' + svc['error'] if svc.get('error') else ''}")


def cmd_status(args, config) -> int:
    try:
        status = fleet_status(jobs.swarm_client(), args.stack)
    except jobs.FleetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status)
    placed = [svc for node in status["nodes"].values() for svc in node["services"].values()]
    return 0 if placed and all(svc.get("healthy") for svc in placed) else 1


def cmd_strategy_dump(args, config) -> int:
    out = Path(args.out)
    try:
        client = jobs.swarm_client()
        boards = {n.attrs["Description"]["Hostname"]: n.attrs["Spec"].get("Labels", {}).get(BOARD_LABEL)
                  for n in client.nodes.list()}
        found = jobs.run_probe(client, args.stack, ["dump"], beside="optimizer", progress=_progress)
    except jobs.FleetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    out.mkdir(parents=True, exist_ok=True)
    for node in found:
        if "strategy" in node:
            (out / f"{node['node']}.json").write_text(json.dumps(node["strategy"], indent=2) + "\n")
        print(f"{node['node']:<16} board {boards.get(node['node']) or '-':<12} "
              f"{node.get('error') or out / (node['node'] + '.json')}")
    (out / "boards.json").write_text(json.dumps({n["node"]: boards.get(n["node"]) for n in found}, indent=2) + "\n")
    return 0 if found and all("strategy" in n for n in found) else 1


def cmd_strategy_restore(args, config) -> int:
    data = Path(args.file).read_bytes()
    constraints = [f"node.labels.{BOARD_LABEL} == {args.board}"] if args.board else []
    constraints += [f"node.hostname == {args.node}"] if args.node else []
    try:
        client = jobs.swarm_client()
        jobs.stack_services(client, args.stack)
        document = client.configs.create(name=f"{args.stack}_strategy-{hashlib.sha256(data).hexdigest()[:12]}",
                                         data=data, labels={jobs.STACK_LABEL: args.stack})
    except jobs.FleetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    import docker.types

    try:
        reference = docker.types.ConfigReference(document.id, document.name, filename=STRATEGY_PATH, uid="10001",
                                                 mode=0o400)
        found = jobs.run_probe(client, args.stack, ["restore", STRATEGY_PATH], beside="optimizer",
                               constraints=constraints, extra_configs=[reference], progress=_progress)
    except jobs.FleetError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        document.remove()
    for node in found:
        print(f"{node['node']:<16} {node.get('error') or 'restored: ' + json.dumps(node['strategy']['settings'])}")
    if not found:
        print("error: no robot node matched", file=sys.stderr)
    return 0 if found and all("strategy" in n for n in found) else 1


def register(sub: argparse._SubParsersAction) -> None:
    fleet = sub.add_parser("fleet", help="the stack on Docker Swarm: stack file, status, strategies",
                           description="Run Magnitude on a Docker Swarm: one stack, every service once on each "
                                       "node labelled magnitude.role=robot (docs/fleet.md). status and strategy "
                                       "run on a manager.")
    fsub = fleet.add_subparsers(dest="fleet_command", required=True)
    p = fsub.add_parser("stack", help="write the Swarm stack file generated from compose.yaml",
                        description="Write OUT/stack.yaml (from compose.yaml: limits, restarts and placement as "
                                    "Swarm says them, shared memory on a tmpfs volume, the API keys as a secret) "
                                    "and OUT/magnitude.yaml, its Swarm config.")
    p.add_argument("--out", default="swarm", metavar="DIR", help="where to write them (default ./swarm)")
    p.add_argument("--compose", default=str(REPO / "compose.yaml"), metavar="FILE", help="the compose file")
    p.add_argument("--image-config", default=str(REPO / "docker" / "magnitude.yaml"), metavar="FILE",
                   help="the containers' configuration it starts from")
    p.add_argument("--inference-node", action="store_true",
                   help=f"inference and the optimizer on the node labelled {ROLE_LABEL}=inference, reached by the "
                        "robots over tcp with CURVE (light robots; docs/fleet.md)")
    p.add_argument("--robot-constraint", metavar="EXPR", help=f"where the robots' services run (default "
                                                               f"node.labels.{ROLE_LABEL} == robot)")
    p.add_argument("--inference-constraint", metavar="EXPR", help=f"with --inference-node: where inference runs "
                                                                   f"(default node.labels.{ROLE_LABEL} == inference)")
    p.set_defaults(fn=cmd_stack)
    p = fsub.add_parser("status", help="every node's services: task, health, queue, tok/s, strategy age, model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(fn=cmd_status)
    strategy = fsub.add_parser("strategy", help="collect every node's learned strategy, or push one to nodes")
    ssub = strategy.add_subparsers(dest="strategy_command", required=True)
    p = ssub.add_parser("dump", help="the strategy of every node's optimizer into DIR/NODE.json (and DIR/boards.json)")
    p.add_argument("--out", required=True, metavar="DIR")
    p.set_defaults(fn=cmd_strategy_dump)
    p = ssub.add_parser("restore", help="make FILE the strategy of the optimizers on the nodes of one board kind "
                                        "(or on one node)")
    p.add_argument("file", metavar="FILE")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--board", metavar="KIND", help=f"nodes labelled {BOARD_LABEL}=KIND")
    where.add_argument("--node", metavar="HOSTNAME", help="one node")
    p.set_defaults(fn=cmd_strategy_restore)
    for p in (*fsub.choices.values(), *ssub.choices.values()):
        if p is not strategy and p.prog.split()[-1] != "stack":
            p.add_argument("--stack", default="magnitude", help="the stack's name (default magnitude)")
