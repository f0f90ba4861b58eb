"""The memory database: one SQLite file holding texts, their vectors (sqlite-vec) and an FTS5 index.

Why these choices:

* ``apsw`` rather than the stdlib ``sqlite3``: Python builds without
  ``enable_load_extension`` (this machine's is one) cannot load sqlite-vec;
  apsw's wheel bundles its own SQLite that can, on the host and in the image.
* WAL with ``synchronous=FULL``: every commit fsyncs the WAL before
  ``upsert`` returns, so a write that was acknowledged survives kill -9 and
  power loss; readers never wait on the writer. NORMAL would be consistent
  but could lose the last commits on power loss, which an acknowledged write
  must not.
* One transaction per call: the row in ``docs``, its vector in ``vec_docs``
  and its terms in ``fts_docs`` change together or not at all, so a crash
  mid-ingest leaves the three in step.

Rows share one rowid across the three tables. Vectors are L2-normalised float32
and compared by cosine distance; ``score`` is cosine similarity (1 - distance).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, cast

import apsw
import numpy as np
import sqlite_vec

from shared.protocol import bad_request
from shared.security import private_dir

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS docs (
    rowid INTEGER PRIMARY KEY,
    collection TEXT NOT NULL,
    doc_id TEXT NOT NULL,
    text TEXT NOT NULL,
    metadata TEXT NOT NULL DEFAULT '{}',
    updated_at REAL NOT NULL,
    UNIQUE (collection, doc_id)
);
CREATE VIRTUAL TABLE IF NOT EXISTS fts_docs USING fts5(text, tokenize = 'porter unicode61');
"""
_FILTER_KEY = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SCALARS = (str, int, float, bool)



def _fts_query(text: str) -> str | None:
    """An FTS5 MATCH expression that ORs the text's words, each quoted so no input is FTS syntax."""
    words = re.findall(r"\w+", text.lower())
    return " OR ".join(f'"{w}"' for w in dict.fromkeys(words)) or None


def _pairs(cursor: apsw.Cursor) -> list[tuple[Any, Any]]:
    """The rows of a two-column query (apsw types a row as a tuple of any length)."""
    return cast("list[tuple[Any, Any]]", cursor.fetchall())


def _filter_sql(filter: dict[str, Any] | None) -> tuple[str, list[Any]]:
    """``AND json_extract(...) = ?`` clauses for an equality filter on metadata keys."""
    if not filter:
        return "", []
    clauses, params = [], []
    for key, value in filter.items():
        if not isinstance(key, str) or not _FILTER_KEY.match(key):
            raise bad_request(f"filter key {key!r} must be 1-64 chars of letters, digits, '_', '.', '-'")
        if not isinstance(value, _SCALARS):
            raise bad_request(f"filter value for {key!r} must be a string, number or bool")
        if isinstance(value, int) and not -(1 << 63) <= value < 1 << 63:  # SQLite's integers are 64-bit
            raise bad_request(f"filter value for {key!r} is outside the 64-bit integer range")
        clauses.append("json_extract(d.metadata, ?) = ?")
        params += [f'$."{key}"', value]
    return " AND " + " AND ".join(clauses), params


class MemoryStore:
    """Collections of texts with vectors; every method is one transaction."""

    def __init__(self, path: Path):
        self.path = Path(path)
        private_dir(self.path.parent)
        self.db = apsw.Connection(str(self.path))
        self.db.enable_load_extension(True)
        self.db.load_extension(sqlite_vec.loadable_path())
        self.db.enable_load_extension(False)
        self.db.set_busy_timeout(5000)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        with self.db:
            self.db.execute(_SCHEMA)
        meta = dict(_pairs(self.db.execute("SELECT key, value FROM meta")))
        self.dim: int | None = int(meta["dim"]) if "dim" in meta else None
        #: The encoder that made the vectors (None: a database from before it was recorded, or an empty one).
        self.encoder: str | None = meta.get("encoder")

    def close(self) -> None:
        self.db.close()

    # --- writes ------------------------------------------------------------------------------
    def _create_vectors(self, dim: int) -> None:
        self.db.execute(f"CREATE VIRTUAL TABLE IF NOT EXISTS vec_docs USING vec0("
                        f"collection TEXT PARTITION KEY, embedding FLOAT[{int(dim)}] distance_metric=cosine)")
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('dim', ?)", (str(dim),))

    def _ensure_dim(self, dim: int) -> None:
        if self.dim is None:
            self._create_vectors(dim)
            self.dim = dim
        elif dim != self.dim:
            raise bad_request(f"vectors have {dim} dimensions; this database stores {self.dim}")

    def record_encoder(self, encoder: str) -> None:
        """Name the encoder of the vectors stored (a database from before names were kept, or a new one)."""
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('encoder', ?)", (encoder,))
        self.encoder = encoder

    def replace_vectors(self, encoder: str, rowids: list[int], vectors: np.ndarray | None) -> None:
        """Every row's vector from ``encoder`` (``rowids`` in the order ``texts()`` gave; None: there are no
        rows), in one transaction: a crash midway leaves the old encoder's vectors, all of them, and says so."""
        with self.db:
            collections = dict(_pairs(self.db.execute("SELECT rowid, collection FROM docs")))
            if self.dim is not None:
                self.db.execute("DROP TABLE vec_docs")
                self.db.execute("DELETE FROM meta WHERE key = 'dim'")
            if vectors is not None:
                vectors = np.ascontiguousarray(vectors, dtype=np.float32)
                self._create_vectors(vectors.shape[1])
                for rowid, vector in zip(rowids, vectors, strict=True):
                    self.db.execute("INSERT INTO vec_docs (rowid, collection, embedding) VALUES (?, ?, ?)",
                                    (rowid, collections[rowid], vector.tobytes()))
            self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('encoder', ?)", (encoder,))
        self.dim, self.encoder = (None if vectors is None else vectors.shape[1]), encoder

    def upsert(self, collection: str, items: list[tuple[str, str, dict]], vectors: np.ndarray) -> list[int]:
        """Store (id, text, metadata) rows with their vectors, replacing same-id rows; return rowids."""
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.shape[0] != len(items):
            raise ValueError("one vector per item")
        now = time.time()
        rowids = []
        with self.db:  # one transaction: committed (and fsynced) when the block exits
            self._ensure_dim(vectors.shape[1])
            for (doc_id, text, metadata), vector in zip(items, vectors):
                (rowid,) = self.db.execute(
                    "INSERT INTO docs (collection, doc_id, text, metadata, updated_at) VALUES (?, ?, ?, ?, ?) "
                    "ON CONFLICT (collection, doc_id) DO UPDATE SET text = excluded.text, "
                    "metadata = excluded.metadata, updated_at = excluded.updated_at RETURNING rowid",
                    (collection, doc_id, text, json.dumps(metadata), now)).fetchone()
                # vec0 and fts5 have no upsert: replace the row.
                self.db.execute("DELETE FROM vec_docs WHERE rowid = ?", (rowid,))
                self.db.execute("DELETE FROM fts_docs WHERE rowid = ?", (rowid,))
                self.db.execute("INSERT INTO vec_docs (rowid, collection, embedding) VALUES (?, ?, ?)",
                                (rowid, collection, vector.tobytes()))
                self.db.execute("INSERT INTO fts_docs (rowid, text) VALUES (?, ?)", (rowid, text))
                rowids.append(rowid)
        return rowids

    def delete(self, collection: str, doc_id: str) -> bool:
        with self.db:
            row = self.db.execute("DELETE FROM docs WHERE collection = ? AND doc_id = ? RETURNING rowid",
                                  (collection, doc_id)).fetchone()
            if row is None:
                return False
            if self.dim is not None:
                self.db.execute("DELETE FROM vec_docs WHERE rowid = ?", row)
            self.db.execute("DELETE FROM fts_docs WHERE rowid = ?", row)
        return True

    # --- reads -------------------------------------------------------------------------------
    def _vector_hits(self, collection: str, vector: bytes, n: int, filter: dict | None) -> dict[int, float]:
        """rowid -> cosine distance of the n nearest rows; exact either way (sqlite-vec scans)."""
        where, params = _filter_sql(filter)
        if not where:
            rows = self.db.execute("SELECT rowid, distance FROM vec_docs WHERE embedding MATCH ? AND k = ? "
                                   "AND collection = ?", (vector, n, collection))
        else:  # KNN then filter could return fewer than n: rank the filtered rows directly
            rows = self.db.execute(
                "SELECT d.rowid, vec_distance_cosine(v.embedding, ?) AS dist FROM docs d "
                f"JOIN vec_docs v ON v.rowid = d.rowid WHERE d.collection = ?{where} ORDER BY dist LIMIT ?",
                (vector, collection, *params, n))
        return dict(_pairs(rows))

    def _keyword_hits(self, collection: str, text: str, n: int, filter: dict | None) -> dict[int, float]:
        """rowid -> BM25 relevance (higher is better) of the n best keyword matches."""
        match = _fts_query(text)
        if match is None:
            return {}
        where, params = _filter_sql(filter)
        rows = self.db.execute(
            "SELECT f.rowid, -bm25(fts_docs) AS s FROM fts_docs f JOIN docs d ON d.rowid = f.rowid "
            f"WHERE fts_docs MATCH ? AND d.collection = ?{where} ORDER BY s DESC LIMIT ?",
            (match, collection, *params, n))
        return dict(_pairs(rows))

    def query(self, collection: str, vector: np.ndarray, k: int, filter: dict | None = None,
              keyword_text: str | None = None, keyword_weight: float = 0.3) -> list[dict]:
        """Top-k rows by cosine similarity; with ``keyword_text`` by
        ``(1 - w) * cosine + w * bm25 / max_bm25`` over the union of both candidate lists."""
        if self.dim is None:
            return []
        vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(-1)
        if vector.shape[0] != self.dim:
            raise bad_request(f"query vector has {vector.shape[0]} dimensions; this database stores {self.dim}")
        blob = vector.tobytes()
        if keyword_text is None:
            scores = {r: 1.0 - d for r, d in self._vector_hits(collection, blob, k, filter).items()}
            keyword = {}
        else:
            pool = max(4 * k, 20)
            distances = self._vector_hits(collection, blob, pool, filter)
            keyword = self._keyword_hits(collection, keyword_text, pool, filter)
            missing = [r for r in keyword if r not in distances]
            if missing:  # keyword-only candidates still need their cosine
                marks = ",".join("?" * len(missing))
                distances.update(_pairs(self.db.execute(
                    f"SELECT rowid, vec_distance_cosine(embedding, ?) FROM vec_docs WHERE rowid IN ({marks})",
                    (blob, *missing))))
            top = max(keyword.values(), default=0.0) or 1.0
            keyword = {r: s / top for r, s in keyword.items()}
            scores = {r: (1 - keyword_weight) * (1.0 - d) + keyword_weight * keyword.get(r, 0.0)
                      for r, d in distances.items()}
        best = sorted(scores, key=scores.get, reverse=True)[:k]
        if not best:
            return []
        rows = {r[0]: r[1:] for r in self.db.execute(
            f"SELECT rowid, doc_id, text, metadata FROM docs WHERE rowid IN ({','.join('?' * len(best))})", best)}
        return [{"id": rows[r][0], "text": rows[r][1], "metadata": json.loads(rows[r][2]),
                 "score": round(float(scores[r]), 6), **({"keyword": round(keyword.get(r, 0.0), 4)}
                                                         if keyword_text is not None else {})}
                for r in best if r in rows]

    def texts(self) -> list[tuple[int, str]]:
        """(rowid, text) of every row, in rowid order: what a new encoder embeds."""
        return _pairs(self.db.execute("SELECT rowid, text FROM docs ORDER BY rowid"))

    def get(self, collection: str, doc_id: str) -> dict | None:
        row = self.db.execute("SELECT text, metadata FROM docs WHERE collection = ? AND doc_id = ?",
                              (collection, doc_id)).fetchone()
        return None if row is None else {"id": doc_id, "text": row[0], "metadata": json.loads(row[1])}

    def ids(self, collection: str) -> set[str]:
        return {r[0] for r in self.db.execute("SELECT doc_id FROM docs WHERE collection = ?", (collection,))}

    def stats(self, collection: str | None = None) -> dict:
        sql = "SELECT collection, count(*) FROM docs" + (" WHERE collection = ?" if collection else "")
        counts = dict(_pairs(self.db.execute(sql + " GROUP BY collection", (collection,) if collection else ())))
        files = [self.path, self.path.with_name(self.path.name + "-wal")]
        return {"collections": counts, "documents": sum(counts.values()), "dim": self.dim, "encoder": self.encoder,
                "db_path": str(self.path), "db_bytes": sum(f.stat().st_size for f in files if f.exists())}
