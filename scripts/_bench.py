"""What the benchmark scripts share: a real inference service started as its own process."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magnitude import launcher  # noqa: E402
from shared import catalog, process  # noqa: E402
from shared.client import Client  # noqa: E402
from shared.config import Config, dump_config, parse_config  # noqa: E402


#: An agent's system prompt (a household robot's planner) and tasks, for the benchmarks that step agents.
PLANNER_SYSTEM = (
    "You are the task planner of a household robot. You can use these tools: "
    "move_to(room) moves the robot to a room; pick(object) picks up an object that is in reach; "
    "place(object, location) puts a held object down; open(container) opens a door, drawer or fridge; "
    "say(text) speaks to the user; look() describes what the camera sees; wait(seconds) pauses. "
    "Rules: plan one step at a time, check the result of every step before the next, never hold more "
    "than one object, keep the user informed, and stop when the task is complete. The house has a "
    "kitchen, a living room, a bedroom, a bathroom and a hallway. The user is in the living room. "
)
PLANNER_TASKS = ["bring a glass of water", "find the red book", "water the plants", "close every window",
                 "charge the vacuum", "fold the towels", "feed the cat", "check the front door"]


#: The model of the benchmarks that measure the engine rather than an agent: the small bundled base model.
BENCH_MODEL = catalog.get(catalog.BASE_MODEL).path()


def stop_services_on_sigterm() -> None:
    """Make SIGTERM (``timeout``, ``kill``) exit through the script's ``finally`` blocks, which stop the services
    it started; by default it ends Python at once and leaves them running."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def start_inference(home: Path, tag: str, engine: dict, timeout_s: float = 300) -> tuple[Config, Client]:
    """Start ``services.inference`` with these engine settings under ``home`` (``model_path``: ``BENCH_MODEL``
    unless given); stop it with ``stop``."""
    config = parse_config({"engine": {"model_path": str(BENCH_MODEL), **engine},
                           "runtime": {"runtime_dir": str(home / f"run-{tag}"), "data_dir": str(home / "data"),
                                       "queue_size": 8}})
    path = home / f"bench-{tag}.yaml"
    path.write_text(dump_config(config))
    status = launcher.start(config, "inference", str(path), progress=lambda m: print(m, file=sys.stderr))
    if not status.healthy:
        sys.exit(f"inference did not start: {status.error}")
    return config, Client(config.runtime.endpoint("inference"), timeout_s=timeout_s)


def stop(config: Config, client: Client) -> None:
    client.close()
    process.stop(config, "inference")
