"""MemoryStore on its own: replace, delete, filters, hybrid keyword scores, typed errors (no model needed)."""

import numpy as np
import pytest

from services.retrieval.store import MemoryStore
from shared.protocol import ProtocolError


@pytest.fixture
def store(tmp_path):
    s = MemoryStore(tmp_path / "m.db")
    eye = np.eye(4, dtype=np.float32)
    s.upsert("c", [("cat", "the cat sat on the mat", {"room": "hall"}),
                   ("dog", "dogs bark at the postman", {"room": "yard"}),
                   ("both", "cats and dogs share a home", {"room": "hall"})], eye[:3])
    s.upsert("other", [("x", "unrelated collection", {})], eye[3:])
    yield s
    s.close()


def test_wal_and_full_sync(store):
    assert store.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert store.db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


def test_upsert_replaces_and_delete_removes(store):
    store.upsert("c", [("cat", "a new cat text", {"room": "attic"})], np.array([[0, 0, 0, 1]], np.float32))
    assert store.get("c", "cat") == {"id": "cat", "text": "a new cat text", "metadata": {"room": "attic"}}
    assert store.query("c", [0, 0, 0, 1], 1)[0]["id"] == "cat"  # the old vector is gone with the old text
    assert store.stats("c")["documents"] == 3
    assert store.delete("c", "cat") and not store.delete("c", "cat")
    assert store.ids("c") == {"dog", "both"} and store.ids("other") == {"x"}


def test_collections_and_filters(store):
    q = [1, 0.1, 0.1, 0.9]
    assert [h["id"] for h in store.query("c", q, 5)] == ["cat", "both", "dog"]  # "other" never leaks in
    assert [h["id"] for h in store.query("c", q, 5, filter={"room": "hall"})] == ["cat", "both"]
    assert store.query("c", q, 5, filter={"room": "nowhere"}) == []


def test_hybrid_lifts_keyword_matches(store):
    q = [1, 0, 0, 0]  # pure vector says "cat" first
    hits = store.query("c", q, 3, keyword_text="postman", keyword_weight=0.9)
    assert hits[0]["id"] == "dog" and hits[0]["keyword"] == 1.0
    assert store.query("c", q, 3, keyword_text='"; DROP TABLE docs; --', keyword_weight=0.5)  # quoted, harmless


def test_bad_input_is_typed(store):
    with pytest.raises(ProtocolError, match="dimensions"):
        store.query("c", [1, 0], 1)
    with pytest.raises(ProtocolError, match="dimensions"):
        store.upsert("c", [("z", "z", {})], np.ones((1, 8), np.float32))
    with pytest.raises(ProtocolError, match="filter key"):
        store.query("c", [1, 0, 0, 0], 1, filter={"a'b": 1})
    with pytest.raises(ProtocolError, match="filter value"):
        store.query("c", [1, 0, 0, 0], 1, filter={"room": ["hall"]})


def test_reopen_keeps_everything(tmp_path):
    s = MemoryStore(tmp_path / "m.db")
    s.upsert("c", [("a", "alpha", {})], np.ones((1, 3), np.float32))
    s.close()
    again = MemoryStore(tmp_path / "m.db")
    assert again.dim == 3 and again.query("c", [1, 1, 1], 1)[0]["id"] == "a"


def test_vectors_of_another_encoder_replace_every_old_one_and_keep_the_texts(store):
    """A new encoder's vectors, of another size, replace all of the old ones in one go; ids, texts, metadata and
    collections stay, and the database names the encoder after a reopen."""
    rows = store.texts()
    assert [text for _, text in rows] == ["the cat sat on the mat", "dogs bark at the postman",
                                          "cats and dogs share a home", "unrelated collection"]
    store.replace_vectors("new-encoder", [rowid for rowid, _ in rows], np.eye(6, dtype=np.float32)[2:])
    assert store.dim == 6 and store.encoder == "new-encoder"
    assert store.query("c", [0, 0, 0, 1, 0, 0], 1)[0] == {"id": "dog", "text": "dogs bark at the postman",
                                                          "metadata": {"room": "yard"}, "score": 1.0}
    assert store.query("other", [0, 0, 0, 0, 0, 1], 3)[0]["id"] == "x" and len(store.query("other", [1] * 6, 9)) == 1
    with pytest.raises(ProtocolError):  # the old size is gone
        store.query("c", [1, 0, 0, 0], 1)
    path = store.path
    store.close()
    again = MemoryStore(path)
    assert (again.dim, again.encoder, again.ids("c")) == (6, "new-encoder", {"cat", "dog", "both"})
    again.close()


def test_a_database_without_rows_takes_another_encoder_at_any_size(tmp_path):
    s = MemoryStore(tmp_path / "m.db")
    s.upsert("c", [("a", "alpha", {})], np.ones((1, 3), np.float32))
    s.delete("c", "a")
    s.replace_vectors("new-encoder", [], None)
    assert s.dim is None and s.encoder == "new-encoder"
    s.upsert("c", [("b", "beta", {})], np.ones((1, 5), np.float32))
    assert s.dim == 5 and s.query("c", [1] * 5, 1)[0]["id"] == "b"
    s.close()
