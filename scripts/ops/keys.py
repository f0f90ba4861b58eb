"""Create keys for what is exposed beyond loopback: CURVE keys for ZeroMQ endpoints, API keys for the gateway.

    scripts/ops/keys init [--client NAME ...]   server keypair (once) + client keypairs
    scripts/ops/keys client NAME                one more authorized client
    scripts/ops/keys local                      the first-start key 'local' (made once; says where its 0600 file is)
    scripts/ops/keys api-key NAME               a gateway API key for NAME (printed once; a new one replaces NAME's)
    scripts/ops/keys revoke-api-key NAME        the gateway rejects NAME's key from its next request on
    scripts/ops/keys api-keys                   names of the gateway's API keys
    scripts/ops/keys list                       authorized clients

CURVE keys go to runtime.keys_dir (default $MAGNITUDE_HOME/data/keys). Give a
client its ``client-NAME.key_secret`` file plus ``server.key``; remove
``clients/NAME.key`` (and restart the services) to revoke it.

API keys: the gateway keeps only their SHA-256 in gateway.api_keys_file
(default keys_dir/api_keys) and reads it again when it changes, so no restart
is needed. Send one as ``Authorization: Bearer KEY`` (the openai SDK's
``api_key``).
"""

import argparse
import os
import sys

from services.gateway.keys import ApiKeys, create_key, ensure_local_key, keys_path, local_key_path, revoke_key
from shared.config import ConfigError, load_config
from shared.security import create_keys


def main() -> int:
    os.umask(0o077)  # nothing this command writes is for other users (key files also set their own mode)
    parser = argparse.ArgumentParser(prog="scripts/ops/keys", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="YAML config (for runtime.keys_dir and gateway.api_keys_file)")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("init", help="server keypair plus client keypairs")
    p.add_argument("--client", action="append", default=None, help="client name (default: the config's client_key)")
    sub.add_parser("client", help="add an authorized client").add_argument("name")
    sub.add_parser("local", help="make the first-start key (once) and say where it is")
    sub.add_parser("api-key", help="make a gateway API key (printed once)").add_argument("name")
    sub.add_parser("revoke-api-key", help="revoke a gateway API key").add_argument("name")
    sub.add_parser("api-keys", help="list the gateway's API key names")
    sub.add_parser("list", help="list authorized clients")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 2
    keys_dir = config.runtime.resolved_keys_dir()
    api_keys = keys_path(config)
    try:
        if args.command == "api-key":
            key = create_key(api_keys, args.name)
            print(f"API key for {args.name} (shown once; only its hash is kept in {api_keys}):", file=sys.stderr)
            print(key)
            return 0
        if args.command == "local":
            made = ensure_local_key(config)
            where = local_key_path(config)
            if made or where.exists():
                print(f"gateway API key: {where} ({'made now, ' if made else ''}readable by you only); clients "
                      "send it as Authorization: Bearer KEY (magnitude.api_key() reads it)")
            else:
                print(f"gateway API keys already exist in {api_keys} (no {where}): use yours", file=sys.stderr)
            return 0
        if args.command == "revoke-api-key":
            if not revoke_key(api_keys, args.name):
                print(f"no API key named {args.name!r} in {api_keys}", file=sys.stderr)
                return 1
            print(f"revoked {args.name}", file=sys.stderr)
            return 0
        if args.command == "api-keys":
            for name in ApiKeys(api_keys).names():
                print(name)
            return 0
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    if args.command == "list":
        for key in sorted((keys_dir / "clients").glob("*.key")):
            print(key.stem)
        return 0
    names = [args.name] if args.command == "client" else (args.client or [config.runtime.client_key])
    for path in create_keys(keys_dir, names):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
