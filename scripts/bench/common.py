"""What the benchmarks share: a real inference service started as its own process, and SIGTERM handling."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from magnitude import launcher
from shared import catalog, process
from shared.client import Client
from shared.config import Config, dump_config, parse_config

#: The model of the benchmarks that measure the engine rather than an agent: the small bundled base model.
BENCH_MODEL = catalog.get(catalog.BASE_MODEL).path()


def add_side_by_side_arguments(parser: argparse.ArgumentParser, n_ctx_help: str) -> None:
    """The flags of a benchmark that runs Magnitude and llama-server on the same model, one side at a time."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=4096, help=n_ctx_help)
    parser.add_argument("--reps", type=int, default=1, help="alternating runs per side; medians are printed")
    parser.add_argument("--only", choices=["magnitude", "llama-server"], help="run one side (no ratios)")
    parser.add_argument("--server", help="llama-server binary (default: built/cached by native/build_llama_server.sh)")
    parser.add_argument("--model", default=str(BENCH_MODEL))


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
