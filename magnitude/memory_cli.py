"""``magnitude memory add/query/delete/stats``: long-term memory from a shell, through the retrieval service."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

from shared.client import ServiceError
from magnitude.memory import MemoryClient

_BATCH = 256


def _pairs(values: list[str] | None) -> dict:
    """``key=value`` arguments as a map; values that parse as JSON (numbers, true) keep their type."""
    out = {}
    for item in values or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out


def _run(args, config, action) -> int:
    memory = MemoryClient.for_config(config, timeout_s=args.timeout)
    try:
        return action(memory)
    except ServiceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    finally:
        memory.close()


def cmd_add(args, config) -> int:
    texts = [line.strip() for line in open(args.file, encoding="utf-8")] if args.file else [args.text]
    texts = [t for t in texts if t]
    if not texts or (args.id and len(texts) > 1):
        print("error: give one TEXT (optionally --id) or --file with one document per line", file=sys.stderr)
        return 2
    metadata = _pairs(args.meta)

    def add(memory: MemoryClient) -> int:
        items = [{"id": args.id or hashlib.sha1(t.encode()).hexdigest()[:16], "text": t, "metadata": metadata}
                 for t in texts]
        for start in range(0, len(items), _BATCH):
            memory.upsert_many(args.collection, items[start:start + _BATCH])
        for item in items[:20]:
            print(f"{item['id']}  {item['text'][:80]}")
        print(f"added {len(items)} to {args.collection!r}", file=sys.stderr)
        return 0
    return _run(args, config, add)


def cmd_query(args, config) -> int:
    def query(memory: MemoryClient) -> int:
        hits = memory.query(args.collection, text=args.text, k=args.k, filter=_pairs(args.where) or None,
                            hybrid=args.hybrid)
        if args.json:
            print(json.dumps(hits, indent=2))
        for h in [] if args.json else hits:
            print(f"{h['score']:.3f}  {h['id']:<18} {h['text'][:100]}")
        return 0
    return _run(args, config, query)


def cmd_delete(args, config) -> int:
    def delete(memory: MemoryClient) -> int:
        found = memory.delete(args.collection, args.id)
        print("deleted" if found else "not found")
        return 0 if found else 1
    return _run(args, config, delete)


def cmd_stats(args, config) -> int:
    def stats(memory: MemoryClient) -> int:
        s = memory.stats(args.collection)
        if args.json:
            print(json.dumps(s, indent=2))
            return 0
        print(f"{s['documents']} documents, dim={s['dim']}, {s['db_bytes'] / 2**20:.1f} MiB at {s['db_path']}")
        for name, count in sorted(s["collections"].items()):
            print(f"  {name:<24} {count}")
        return 0
    return _run(args, config, stats)


def register(sub: argparse._SubParsersAction) -> None:
    memory = sub.add_parser("memory", help="long-term memory: add, query, delete, stats")
    msub = memory.add_subparsers(dest="memory_command", required=True)

    def common(p: argparse.ArgumentParser, collection: str | None = "default") -> argparse.ArgumentParser:
        p.add_argument("--collection", default=collection, help=f"collection name (default: {collection})")
        p.add_argument("--timeout", type=float, default=120.0)
        return p

    p = common(msub.add_parser("add", help="store a text (or a file, one document per line)"))
    p.add_argument("text", nargs="?")
    p.add_argument("--file", help="UTF-8 file, one document per line")
    p.add_argument("--id", help="document id (default: a hash of the text)")
    p.add_argument("--meta", action="append", metavar="KEY=VALUE", help="metadata (repeatable)")
    p.set_defaults(fn=cmd_add)
    p = common(msub.add_parser("query", help="nearest stored texts to TEXT"))
    p.add_argument("text")
    p.add_argument("-k", type=int, default=5)
    p.add_argument("--hybrid", action="store_true", help="blend in FTS5 keyword scores")
    p.add_argument("--where", action="append", metavar="KEY=VALUE", help="metadata must equal (repeatable)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_query)
    p = common(msub.add_parser("delete", help="remove a document by id"))
    p.add_argument("id")
    p.set_defaults(fn=cmd_delete)
    p = common(msub.add_parser("stats", help="document counts and database size"), collection=None)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_stats)
