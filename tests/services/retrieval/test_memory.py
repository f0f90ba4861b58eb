"""Embedding and retrieval services with the real all-MiniLM-L6-v2 GGUF, as separate processes."""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from shared.client import Client, ServiceError
from magnitude.memory import MemoryClient, embed
from services.retrieval.store import MemoryStore
from shared import codecs, shm
from tests.conftest import REPORT, ServiceProcess, make_config, write_config
from tests.data.memory_corpus import DOCS, QUESTIONS

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def embedder(memory_services):
    with Client(memory_services.embedding.endpoint, timeout_s=60) as c:
        yield c


@pytest.fixture(scope="module")
def memory(memory_services):
    m = MemoryClient(Client(memory_services.retrieval.endpoint, timeout_s=120))
    yield m
    m.close()


def test_related_sentences_are_closer(embedder):
    v = embed(embedder, ["A cat is sleeping on the sofa.", "A kitten naps on the couch.",
                         "Interest rates rose by half a percent.", "The train to Paris leaves at noon."])
    assert v.dtype == np.float32 and v.shape == (4, 384)
    assert np.allclose(np.linalg.norm(v, axis=1), 1, atol=1e-4)
    sim = v @ v.T
    REPORT.append(f"cosine related={sim[0, 1]:.3f} unrelated={sim[0, 2]:.3f},{sim[0, 3]:.3f},{sim[1, 2]:.3f}")
    assert sim[0, 1] > 0.5 > max(sim[0, 2], sim[0, 3], sim[1, 2])


def test_large_batch_comes_through_shm(embedder):
    texts = [f"note number {i} about the garden" for i in range(200)]  # 200 x 384 x 4 B > inline limit
    body = embedder.request("embed", {"texts": texts})
    assert "vectors_shm" in body and "vectors" not in body
    name = body["vectors_shm"]["name"]
    vectors = codecs.take_array(body["vectors_shm"])
    assert vectors.shape == (200, 384) and name not in shm.list_segments()  # taken once, then gone
    small = embedder.request("embed", {"texts": texts[:2]})
    assert "vectors" in small and np.allclose(np.frombuffer(small["vectors"], np.float32).reshape(2, 384),
                                              vectors[:2], atol=1e-5)


def test_recall_at_3_on_paraphrased_questions(memory):
    items = [{"id": k, "text": v, "metadata": {"topic": k}} for k, v in DOCS.items()]
    assert memory.upsert_many("corpus", items)["committed"]
    assert memory.stats("corpus")["documents"] == len(DOCS) >= 50
    for hybrid in (False, True):
        hits = sum(any(h["id"] == want for h in memory.query("corpus", text=q, k=3, hybrid=hybrid))
                   for q, want in QUESTIONS)
        REPORT.append(f"recall@3 ({'hybrid' if hybrid else 'vector'}) = {hits}/{len(QUESTIONS)} = {hits / len(QUESTIONS):.2f}")
        assert hits / len(QUESTIONS) >= 0.9
    top = memory.query("corpus", text="Where are the extra keys for the house?", k=1,
                       filter={"topic": "keys_location"})
    assert [h["id"] for h in top] == ["keys_location"]


def test_upsert_query_delete_and_vector_query(memory, embedder):
    memory.upsert("notes", "n1", "The robot vacuum is stored under the stairs.", {"kind": "place"})
    memory.upsert("notes", "n2", "Dinner is served at seven thirty.", {"kind": "time"})
    vector = embed(embedder, ["where is the vacuum cleaner kept"])[0].tolist()
    assert memory.query("notes", vector=vector, k=1)[0]["id"] == "n1"
    assert memory.delete("notes", "n1") and not memory.delete("notes", "n1")
    assert [h["id"] for h in memory.query("notes", text="vacuum cleaner", k=5)] == ["n2"]


@pytest.mark.parametrize("msg,body,fragment", [
    ("memory.query", {"collection": "c"}, "exactly one of"),
    ("memory.query", {"collection": "c", "text": "x", "vector": [1.0]}, "exactly one of"),
    ("memory.query", {"collection": "c", "text": "x", "k": 0}, "k must be"),
    ("memory.query", {"collection": "corpus", "vector": [0.1, 0.2]}, "dimensions"),
    ("memory.query", {"collection": "corpus", "text": "x", "filter": {"a b": 1}}, "filter key"),
    ("memory.query", {"collection": "c", "vector": [1, 0, 0, 0], "hybrid": True}, "hybrid"),
    ("memory.upsert", {"collection": "c", "id": "a"}, "missing required field 'text'"),
    ("memory.upsert", {"collection": "c", "id": " ", "text": "t"}, "non-empty"),
    ("memory.upsert", {"collection": "c", "id": "a", "text": "t", "metadata": {"b": b"\x00"}}, "JSON"),
    ("memory.upsert_many", {"collection": "c", "items": [{"id": "a", "text": "t"}, {"id": "a", "text": "u"}]},
     "repeats"),
    ("memory.upsert_many", {"collection": "c", "items": ["nope"]}, "items[0]"),
    ("embed", {"texts": ["ok", ""]}, "texts[1]"),
    ("embed", {"texts": []}, "empty"),
])
def test_bad_input_gets_typed_errors(memory_services, msg, body, fragment):
    endpoint = memory_services.embedding.endpoint if msg == "embed" else memory_services.retrieval.endpoint
    with Client(endpoint, timeout_s=30) as c:
        with pytest.raises(ServiceError) as err:
            c.request(msg, body)
        assert err.value.code == "bad_request" and fragment in err.value.message
        assert c.health()["ok"]


def test_kill_9_mid_ingest_loses_nothing_acknowledged(memory_services, tmp_path_factory):
    """Ingest one document per request in a thread, SIGKILL the retrieval process mid-way, restart it."""
    home = tmp_path_factory.mktemp("dur", numbered=True)
    config = make_config(home)
    config.runtime.endpoints = {"embedding": memory_services.embedding.endpoint}
    path = write_config(home, config)
    svc = ServiceProcess("retrieval", path, config).start()
    acked, stop = [], threading.Event()

    def ingest():
        with Client(svc.endpoint, timeout_s=3) as c:
            for i in range(10_000):
                if stop.is_set():
                    return
                try:
                    c.request("memory.upsert", {"collection": "dur", "id": f"d{i}",
                                                "text": f"durable document {i} about topic {i % 17}"})
                except ServiceError:
                    return
                acked.append(f"d{i}")

    worker = threading.Thread(target=ingest)
    worker.start()
    deadline = time.monotonic() + 60
    while len(acked) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait()
    stop.set()
    worker.join(10)
    assert len(acked) >= 40, "ingest too slow to test"
    svc = ServiceProcess("retrieval", path, config).start()  # same db file
    try:
        db = config.runtime.resolved_data_dir() / "memory.db"
        check = MemoryStore(db)
        assert check.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        present = check.ids("dur")
        vectors = check.db.execute("SELECT count(*) FROM vec_docs").fetchone()[0]
        fts = check.db.execute("SELECT count(*) FROM fts_docs").fetchone()[0]
        check.close()
        assert set(acked) <= present and len(present) - len(acked) <= 1  # at most the one in flight
        assert vectors == fts == len(present)  # docs, vectors and keywords stayed in step
        with Client(svc.endpoint, timeout_s=30) as c:
            hits = c.request("memory.query", {"collection": "dur", "text": f"durable document {acked[-1][1:]}",
                                              "k": 3, "hybrid": True})["hits"]
            assert acked[-1] in [h["id"] for h in hits]
        REPORT.append(f"kill -9 after {len(acked)} acknowledged upserts: all present after restart")
    finally:
        svc.stop()


def test_cli_add_query_stats(memory_services, tmp_path):
    import subprocess
    import sys
    from tests.conftest import REPO

    def cli(*args):
        out = subprocess.run([sys.executable, "-m", "magnitude.cli", "--config",
                              str(memory_services.retrieval.config_path), "memory", *args],
                             capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)))
        return out.returncode, out.stdout, out.stderr

    docs = tmp_path / "docs.txt"
    docs.write_text("The boiler is serviced every October.\nThe cat's vet is Dr. Lopez on Main Street.\n")
    assert cli("add", "--collection", "cli", "--file", str(docs), "--meta", "source=file")[0] == 0
    rc, out, err = cli("add", "--collection", "cli", "--id", "wifi", "The guest wifi password is on the fridge.")
    assert rc == 0 and "wifi" in out
    rc, out, _ = cli("query", "--collection", "cli", "who treats the cat?", "-k", "1")
    assert rc == 0 and "Lopez" in out
    rc, out, _ = cli("query", "--collection", "cli", "boiler", "--where", "source=file", "--hybrid", "--json")
    assert rc == 0 and json.loads(out)[0]["text"].startswith("The boiler")
    rc, out, _ = cli("stats")
    assert rc == 0 and "cli" in out and "documents" in out
    rc, _, err = cli("query", "--collection", "cli", "x", "-k", "0")
    assert rc == 1 and "bad_request" in err
