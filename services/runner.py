"""Common entry point of every service process: ``python -m services.<name> [--config F] [--endpoint E]``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from shared.config import ConfigError, load_config
from shared.security import SecurityError


def run_service(service_cls, name: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m services.{name}",
                                     description=f"Run the Magnitude {name} service in the foreground.")
    parser.add_argument("--config", help="YAML config file (default: $MAGNITUDE_CONFIG or built-in defaults)")
    parser.add_argument("--endpoint", help="ZeroMQ endpoint to bind (default: from config)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        sys.exit(2)
    if args.config:  # what this process starts (the watchdog's restarts) reads the same file
        os.environ["MAGNITUDE_CONFIG"] = os.path.abspath(args.config)
    try:
        service = service_cls(config, args.endpoint)
    except SecurityError as err:
        _exit(name, "refusing to start", err)
    except (OSError, ValueError) as err:  # a missing model file, a taken port, a malformed key file
        _exit(name, "cannot start", err)
    try:
        service.run()
    except SecurityError as err:
        _exit(name, "refusing to start", err)


def _exit(name: str, what: str, err: Exception) -> NoReturn:
    print(f"{name}: {what}: {err}", file=sys.stderr)
    sys.exit(1)
