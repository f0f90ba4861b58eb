"""The compose healthcheck's command line (``scripts/ops/health`` runs it): probe services, exit 1 if any is unhealthy.

Light on purpose: it runs every 15 s in every container, so it loads ``shared.health`` and nothing heavier.
"""

from __future__ import annotations

import argparse
import sys

from shared.config import SERVICE_NAMES, WATCHDOG_NAME, ConfigError, load_config
from shared.health import add_arguments, print_statuses, probe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/ops/health", description="Check the running Magnitude services; "
                                     "exit 1 if any is unhealthy.")
    parser.add_argument("--config", help="YAML config (default: $MAGNITUDE_CONFIG, else built-in defaults)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    names = args.service or [*SERVICE_NAMES, *([WATCHDOG_NAME] if config.watchdog.enabled else [])]
    return print_statuses([probe(config, name, args.timeout) for name in names], args.json)


if __name__ == "__main__":
    sys.exit(main())
