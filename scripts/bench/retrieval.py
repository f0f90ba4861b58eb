"""Retrieval throughput at 1k and 10k documents: sqlite-vec (service and in-process) beside a numpy brute force.

Starts its own embedding and retrieval services on a temporary home, builds a
synthetic corpus of distinct sentences, embeds it once through the embedding
service, and measures in the same run:

* ingest docs/s end to end (``memory.upsert_many`` through the retrieval
  service: embed + one fsynced commit per batch) against embed + numpy append;
* ingest docs/s of the index alone (``MemoryStore.upsert`` with the vectors
  already computed, fsync per batch) against numpy append;
* query throughput and p50/p99 latency for k=10 by vector, in-process and
  through the service, against ``argpartition`` over a numpy matrix, plus text
  queries end to end (embedding included); and the top-10 overlap of the two.

    .venv/bin/python -m scripts.bench.retrieval [--sizes 1000 10000] [--queries 200]
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from magnitude import launcher
from magnitude.memory import MemoryClient, embed
from scripts.bench.stats import pct
from services.retrieval.store import MemoryStore
from shared.client import Client
from shared.config import dump_config, parse_config

_BATCH = 64
_K = 10
_SUBJECTS = ["the robot", "grandma", "the delivery drone", "the kitchen sensor", "Maria", "the vacuum", "the cat",
             "the front door", "the garden pump", "the thermostat", "the dog", "the fridge", "Tom", "the printer"]
_VERBS = ["reported", "noticed", "scheduled", "forgot", "repaired", "moved", "cleaned", "checked", "ordered",
          "dropped", "charged", "painted", "measured", "locked", "found"]
_OBJECTS = ["the blue box", "a broken lamp", "fresh bread", "the spare keys", "a water leak", "the red chair",
            "three parcels", "the old radio", "a muddy boot", "the medicine", "a loose cable", "the bike",
            "a birthday card", "the window", "some batteries", "the laundry"]
_WHERE = ["in the hallway", "near the garage", "on the balcony", "under the stairs", "in the attic",
          "by the pond", "in the basement", "at the front gate", "in the study", "beside the oven"]
_WHEN = ["on Monday morning", "last night", "at noon", "before the storm", "after dinner", "at 6 am",
         "during the party", "yesterday", "this afternoon", "on Sunday"]


def corpus(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    seen: set[str] = set()
    while len(seen) < n:
        seen.add(f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} "
                 f"{rng.choice(_WHERE)} {rng.choice(_WHEN)} (note {len(seen)}).")
    return sorted(seen, key=lambda _: rng.random())


def p50_p99(samples_ms: list[float]) -> tuple[float, float]:
    return pct(samples_ms, 50), pct(samples_ms, 99)


def timed(fn, items) -> tuple[float, list[float]]:
    """Run fn over items; total seconds and per-item milliseconds."""
    lat = []
    t0 = time.perf_counter()
    for item in items:
        t = time.perf_counter()
        fn(item)
        lat.append((time.perf_counter() - t) * 1e3)
    return time.perf_counter() - t0, lat


def bench_size(n: int, home: Path, embedder: Client, memory: MemoryClient, n_queries: int) -> list[tuple]:
    docs = corpus(n, seed=n)
    queries = corpus(n_queries, seed=n + 1)  # same vocabulary, different sentences
    batches = [docs[i:i + _BATCH] for i in range(0, n, _BATCH)]

    t0 = time.perf_counter()
    vectors = np.concatenate([embed(embedder, b) for b in batches])
    t_embed = time.perf_counter() - t0
    qvec = embed(embedder, queries)

    # numpy baseline: append into a matrix, then exact top-k by dot product (vectors are unit length).
    t0 = time.perf_counter()
    matrix = np.empty((0, vectors.shape[1]), np.float32)
    for i in range(0, n, _BATCH):
        matrix = np.concatenate([matrix, vectors[i:i + _BATCH]])
    t_np_append = time.perf_counter() - t0

    def np_query(q):
        scores = matrix @ q
        top = np.argpartition(-scores, _K)[:_K]
        return top[np.argsort(-scores[top])]
    t_np_q, lat_np = timed(np_query, qvec)

    # sqlite-vec in-process: the index alone (vectors precomputed, one fsynced commit per batch).
    store = MemoryStore(home / f"inproc-{n}.db")
    t0 = time.perf_counter()
    for i in range(0, n, _BATCH):
        store.upsert("bench", [(f"d{j}", docs[j], {}) for j in range(i, min(i + _BATCH, n))], vectors[i:i + _BATCH])
    t_store_ingest = time.perf_counter() - t0
    t_store_q, lat_store = timed(lambda q: store.query("bench", q, _K), qvec)
    overlap = np.mean([len({int(h["id"][1:]) for h in store.query("bench", q, _K)} & set(np_query(q).tolist())) / _K
                       for q in qvec[:50]])
    store.close()

    # sqlite-vec through the retrieval service: embed + commit per batch, then queries over ZeroMQ.
    collection = f"bench{n}"
    t0 = time.perf_counter()
    for bi, batch in enumerate(batches):
        memory.upsert_many(collection, [{"id": f"d{bi * _BATCH + j}", "text": t} for j, t in enumerate(batch)])
    t_svc_ingest = time.perf_counter() - t0
    t_svc_q, lat_svc = timed(lambda q: memory.query(collection, vector=q.tolist(), k=_K), qvec)
    t_svc_text, lat_text = timed(lambda q: memory.query(collection, text=q, k=_K), queries)
    t_svc_hybrid, lat_hybrid = timed(lambda q: memory.query(collection, text=q, k=_K, hybrid=True), queries)

    nq = len(qvec)
    return [
        (n, "numpy brute force", n / (t_embed + t_np_append), n / t_np_append, nq / t_np_q, *p50_p99(lat_np)),
        (n, "sqlite-vec in-process", n / (t_embed + t_store_ingest), n / t_store_ingest, nq / t_store_q,
         *p50_p99(lat_store)),
        (n, "sqlite-vec service (vector)", n / t_svc_ingest, None, nq / t_svc_q, *p50_p99(lat_svc)),
        (n, "service, text query", None, None, nq / t_svc_text, *p50_p99(lat_text)),
        (n, "service, hybrid text query", None, None, nq / t_svc_hybrid, *p50_p99(lat_hybrid)),
        (n, f"(top-{_K} overlap sqlite-vec vs numpy: {overlap:.3f}; embed alone {n / t_embed:.0f} docs/s)",
         None, None, None, None, None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--queries", type=int, default=200)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="magbench", dir="/tmp"))
    config = parse_config({"runtime": {"runtime_dir": str(home / "run"), "data_dir": str(home / "data")}})
    config_path = home / "config.yaml"
    config_path.write_text(dump_config(config))
    try:
        for name in ("embedding", "retrieval"):
            status = launcher.start(config, name, str(config_path), progress=lambda *_: None)
            if not status.healthy:
                raise SystemExit(f"{name} did not start: {status.error}")
        embedder = Client.for_service("embedding", config, timeout_s=300)
        memory = MemoryClient.for_config(config, timeout_s=300)
        rows = []
        for n in args.sizes:
            rows += bench_size(n, home, embedder, memory, args.queries)
        def fmt(v, spec):
            return format("-", f">{spec.split('.')[0]}") if v is None else format(v, spec)
        print(f"\n{'docs':>6}  {'system':<28} {'ingest e2e':>11} {'index only':>11} {'queries/s':>10} "
              f"{'p50 ms':>8} {'p99 ms':>8}")
        print(f"{'':>6}  {'':<28} {'docs/s':>11} {'docs/s':>11}")
        for n, system, e2e, index, qps, p50, p99 in rows:
            if e2e is None and qps is None:
                print(f"{n:>6}  {system}")
                continue
            print(f"{n:>6}  {system:<28} {fmt(e2e, '11.0f')} {fmt(index, '11.0f')} {fmt(qps, '10.0f')} "
                  f"{fmt(p50, '8.3f')} {fmt(p99, '8.3f')}")
        embedder.close()
        memory.close()
    finally:
        launcher.down(config)
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
