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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from scripts.bench.common import stop_services_on_sigterm
from scripts.bench.stats import median, ratio
from shared import catalog
from shared.security import create_keys

NETWORK, SUBNET, BOX_IP, ROBOT_IP = "mag-lan-bench", "172.30.98.0/24", "172.30.98.10", "172.30.98.20"
BOX, ROBOT = "mag-lan-bench-box", "mag-lan-bench-robot"
SERVICE_UID = 10001

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


def docker(*args: str, check: bool = True) -> str:
    out = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=600)
    if check and out.returncode != 0:
        raise SystemExit(f"docker {' '.join(args[:3])} ...: {out.stderr.strip()[-1500:]}")
    return out.stdout


def prepare(home: Path, model: Path, threads: int) -> None:
    """Keys, the model and the three configurations under ``home`` (mounted at /lan), owned by the image's user."""
    create_keys(home / "keys", ["robot"])
    (home / "robot-side").mkdir()
    shutil.copy(home / "keys" / "server.key", home / "robot-side")
    shutil.copy(home / "keys" / "client-robot.key_secret", home / "robot-side")
    (home / "models").mkdir()
    shutil.copy(model, home / "models")
    engine = {"model_path": f"/lan/models/{model.name}", "n_threads": threads, "self_optimize": False}
    common = {"data_dir": "/lan/box-data", "keys_dir": "/lan/keys"}
    sides = {"box-ipc": {**common, "runtime_dir": "/lan/box-run"},
             "box-tcp": {**common, "runtime_dir": "/lan/box-run", "endpoints": {"inference": "tcp://0.0.0.0:5555"}},
             "robot": {"runtime_dir": "/lan/robot-run", "keys_dir": "/lan/robot-side", "client_key": "robot",
                       "endpoints": {"inference": f"tcp://{BOX_IP}:5555"}}}
    for name, runtime in sides.items():
        document = {"runtime": runtime, "metrics": {"enabled": False}}
        (home / f"{name}.yaml").write_text(yaml.safe_dump({**document, "engine": engine} if name != "robot"
                                                          else document))
    for path in (home, *home.rglob("*")):
        os.chown(path, SERVICE_UID, SERVICE_UID)
        if path.is_dir():
            path.chmod(0o700)


def start_box(image: str, home: Path, side: str) -> None:
    docker("rm", "-f", BOX, check=False)
    docker("run", "-d", "--name", BOX, "--network", NETWORK, "--ip", BOX_IP, "--cpus", "2", "-v", f"{home}:/lan",
           "-e", f"MAGNITUDE_CONFIG=/lan/box-{side}.yaml", image, "python", "-m", "services.inference")
    deadline = time.monotonic() + 180
    while "service_started" not in subprocess.run(["docker", "logs", BOX], capture_output=True, text=True).stderr:
        if time.monotonic() > deadline:
            raise SystemExit(f"inference did not start: {docker('logs', '--tail', '20', BOX)}")
        time.sleep(0.5)


def measure(image: str, home: Path, side: str, chats: int, max_tokens: int) -> dict:
    """One rep of one side: a fresh inference container, then the client's timed chats."""
    start_box(image, home, "ipc" if side == "same box" else "tcp")
    client = ["python", "-c", CLIENT, str(chats), str(max_tokens)]
    if side == "same box":
        out = docker("exec", "-e", "MAGNITUDE_CONFIG=/lan/box-ipc.yaml", BOX, *client)
    else:
        docker("rm", "-f", ROBOT, check=False)
        out = docker("run", "--rm", "--name", ROBOT, "--network", NETWORK, "--ip", ROBOT_IP, "-v", f"{home}:/lan",
                     "-e", "MAGNITUDE_CONFIG=/lan/robot.yaml", image, *client)
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
        home = Path(tmp)
        prepare(home, Path(args.model), args.threads)
        docker("network", "rm", NETWORK, check=False)
        docker("network", "create", "--subnet", SUBNET, NETWORK)
        try:
            for rep in range(args.reps):
                for side in results:
                    print(f"rep {rep + 1}/{args.reps}: {side} ...", file=sys.stderr, flush=True)
                    results[side].append(measure(args.image, home, side, args.chats, args.max_tokens))
        finally:
            docker("rm", "-f", BOX, ROBOT, check=False)
            docker("network", "rm", NETWORK, check=False)
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
