"""Inference on the robot's own box against inference on another box of the LAN: a chat's TTFT and decode rate.

Two containers of the stack's image on a user-defined Docker network, one run, the sides alternating:

  same box      the client runs in the inference container itself, over its ipc socket (the compose stack's path)
  across        the client runs in a second container and reaches the inference container's address over
                tcp + CURVE (the LAN inference box of docs/fleet.md)

Each rep starts the inference container afresh, warms it with one chat, then times ``--chats`` chats (greedy,
no session, each a new question) streamed through ``shared.client``: TTFT from sending to the first piece, decode
rate from the first piece to the last. Medians over the reps; the ratio is across / same box (above 1: the link
costs that much more TTFT; below 1 for tok/s: slower). Chats that fit a context are far under the inline limit
(256 KiB), so both sides send them inline: what differs is the transport (ipc against tcp + CURVE over a veth
pair), which is what a light robot pays for its model on another box. The image must exist (docs/containers.md
builds it; tests/system/ build ``magnitude:e2e``).

    .venv/bin/python -m scripts.bench.lan --image magnitude:e2e --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from scripts.bench.common import stop_services_on_sigterm
from scripts.bench.lan_boxes import BOX_ENDPOINTS, MOUNT, Lan, LanError, docker, prepare
from scripts.bench.stats import median, ratio
from shared import catalog

NETWORK, PREFIX = "mag-lan-bench", "172.30.98"  # the box at .10, the robot at .20
BOX, ROBOT = "mag-lan-bench-box", "mag-lan-bench-robot"

#: The client's side (run in a container): one warm-up chat, then the timed ones; one JSON line.
CLIENT = """
import json, sys, time
from shared.client import ChatResult, Client
chats, max_tokens = int(sys.argv[1]), int(sys.argv[2])
ttft, tps = [], []
with Client.for_service("inference", timeout_s=300) as client:
    for i in range(chats + 1):
        start, first = time.monotonic(), None
        question = [{"role": "user", "content": f"Robot {i}: describe a kitchen in three sentences."}]
        for piece in client.chat_stream(question, None, max_tokens=max_tokens, temperature=0):
            if isinstance(piece, ChatResult):
                tokens = piece.stats.completion_tokens
            elif first is None:
                first = time.monotonic()
        end = time.monotonic()
        if i and first is not None:
            ttft.append(first - start)
            tps.append((tokens - 1) / (end - first) if end > first else 0.0)
print(json.dumps({"ttft_s": ttft, "decode_tps": tps}))
"""


def measure(lan: Lan, side: str, chats: int, max_tokens: int) -> dict:
    """One rep of one side: a fresh inference container, then the client's timed chats."""
    config = "box-ipc.yaml" if side == "same box" else "box-tcp.yaml"
    lan.start_box(BOX, config, timeout_s=180, options=("--cpus", "2"))
    client = ["python", "-c", CLIENT, str(chats), str(max_tokens)]
    if side == "same box":
        out = docker("exec", "-e", f"MAGNITUDE_CONFIG={MOUNT}/{config}", BOX, *client)
    else:
        docker("rm", "-f", ROBOT, check=False)
        out = lan.run(ROBOT, lan.robot_ip, "robot.yaml", *client, detach=False)
    found = json.loads(out.strip().splitlines()[-1])
    return {"ttft_s": median(found["ttft_s"]), "decode_tps": median(found["decode_tps"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.lan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="magnitude:latest", help="the stack's image (default magnitude:latest)")
    parser.add_argument("--model", default=str(catalog.get(catalog.TEST_CHAT_MODEL).path()),
                        help="a GGUF with a chat template (default: the tests' chat model)")
    parser.add_argument("--reps", type=int, default=3, help="alternating reps per side; medians are printed")
    parser.add_argument("--chats", type=int, default=5, help="timed chats per rep (after one warm-up)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        parser.error("run as root: the shared folder is handed to the image's user (uid 10001)")
    stop_services_on_sigterm()
    results: dict[str, list[dict]] = {"same box": [], "across": []}
    with tempfile.TemporaryDirectory(prefix="maglan") as tmp:
        lan = Lan(NETWORK, PREFIX, Path(tmp), args.image)
        prepare(lan.home, Path(args.model), {"n_threads": args.threads, "self_optimize": False},
                {"box-ipc": {}, "box-tcp": {"endpoints": BOX_ENDPOINTS}}, lan.box_ip)
        try:
            lan.create()
            for rep in range(args.reps):
                for side in results:
                    print(f"rep {rep + 1}/{args.reps}: {side} ...", file=sys.stderr, flush=True)
                    results[side].append(measure(lan, side, args.chats, args.max_tokens))
        except LanError as err:
            raise SystemExit(str(err)) from None
        finally:
            lan.remove(BOX, ROBOT)
    print(f"\nmodel {Path(args.model).name}, image {args.image}, {args.threads} threads, {args.chats} chats of "
          f"{args.max_tokens} tokens per rep, median of {args.reps} rep(s) per side")
    print(f"{'metric':<16} {'same box':>10} {'across':>10} {'ratio':>7}")
    for metric in ("ttft_s", "decode_tps"):
        same, across = (median(r[metric] for r in results[side]) for side in ("same box", "across"))
        print(f"{metric:<16} {same:>10.4f} {across:>10.4f} {ratio(across, same):>7.2f}")
    print(f"\nreproduce: .venv/bin/python -m scripts.bench.lan --image {args.image} --reps {args.reps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
