"""What the benchmark scripts share: a real inference service started as its own process."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from magnitude import launcher  # noqa: E402
from shared import process  # noqa: E402
from shared.client import Client  # noqa: E402
from shared.config import Config, dump_config, parse_config  # noqa: E402


def start_inference(home: Path, tag: str, engine: dict, timeout_s: float = 300) -> tuple[Config, Client]:
    """Start ``services.inference`` with these engine settings under ``home``; stop it with ``stop``."""
    config = parse_config({"engine": engine,
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
