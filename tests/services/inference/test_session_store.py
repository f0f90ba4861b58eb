"""Sessions on disk (SessionStore): round trip, fingerprint and damage checks, the LRU bound."""

import os
import time

from services.inference.session_store import SessionStore

FP = {"model": {"path": "/m.gguf", "bytes": 1}, "n_ctx": 4096, "kv_cache_type": "f16"}


def test_round_trip_and_ids_are_not_written_in_clear(tmp_path):
    store = SessionStore(tmp_path, FP, 1 << 20)
    assert store.save("robot-run-42", [1, 2, 300000], b"\x00kv-state\xff")
    assert store.load("robot-run-42") == ([1, 2, 300000], b"\x00kv-state\xff")
    assert store.load("someone-else") is None
    assert not any("robot" in p.name for p in tmp_path.iterdir())
    assert oct(store.path("robot-run-42").stat().st_mode & 0o777) == "0o600"


def test_another_model_or_kv_layout_is_rejected_and_deleted(tmp_path):
    SessionStore(tmp_path, FP, 1 << 20).save("s", [1], b"state")
    other = SessionStore(tmp_path, {**FP, "kv_cache_type": "q8_0"}, 1 << 20)
    assert other.load("s") is None and not other.has("s")


def test_damaged_files_are_rejected_never_raised(tmp_path):
    store = SessionStore(tmp_path, FP, 1 << 20)
    for damage in (lambda b: b[:-3], lambda b: b[:-1] + bytes([b[-1] ^ 1]), lambda b: b"junk", lambda b: b""):
        store.save("s", [1, 2], b"some state")
        path = store.path("s")
        path.write_bytes(damage(path.read_bytes()))
        assert store.load("s") is None and not path.exists()


def test_least_recently_used_files_go_beyond_the_budget(tmp_path):
    store = SessionStore(tmp_path, FP, 3500)  # three files of about 1060 bytes fit, four do not
    for name in ("a", "b", "c"):
        assert store.save(name, [1], b"x" * 900)
        past = time.time() - {"a": 30, "b": 20, "c": 10}[name]
        os.utime(store.path(name), (past, past))
    store.load("a")  # used: now the most recent
    store.save("d", [1], b"x" * 900)
    assert [store.has(n) for n in "abcd"] == [True, False, True, True]
    assert not store.save("huge", [1], b"x" * 4000)  # alone over the budget: not written
