"""The retrieval process: ``memory.*`` messages over a ``MemoryStore``, embedding through the embedding service.

Its own process so database work never shares a worker with generation; it
reaches the embedding service over ZeroMQ with a ``Client`` like any other peer,
so an embedding outage answers ``unavailable``/``timeout`` instead of hanging.
Every write is replied to only after its transaction has committed.
"""

from __future__ import annotations

import json
import time

import numpy as np

from shared.client import Client, ServiceError
from shared.codecs import embed_naming_encoder
from shared.config import Config
from shared.protocol import ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service
from services.retrieval.store import MemoryStore

_MAX_K = 1000


def _require_name(body: dict, key: str) -> str:
    value = body[key]
    if not value.strip():
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{key} must be a non-empty string")
    return value


def _metadata(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}metadata must be a map")
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}metadata must be JSON-like (no bytes)")
    if len(text) > 1 << 16:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}metadata over 64 KiB as JSON")
    return value


class RetrievalService(Service):
    name = "retrieval"
    worker_threads = 1  # one SQLite writer; WAL lets the CLI and tools read the file meanwhile

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        mem = config.memory
        self.db_path = mem.db_path or config.runtime.resolved_data_dir() / "memory.db"
        self.store = MemoryStore(self.db_path)
        self.embedder = Client.for_service("embedding", config, timeout_s=120)
        self.handle("memory.upsert", self.on_upsert)
        self.handle("memory.upsert_many", self.on_upsert_many)
        self.handle("memory.delete", self.on_delete)
        self.handle("memory.query", self.on_query)
        self.handle("memory.stats", lambda req, _: self.store.stats(req.body.get("collection")))

    def health_details(self) -> dict:
        return {"db_path": str(self.db_path), "dim": self.store.dim}

    def close(self) -> None:
        self.embedder.close()
        self.store.close()

    def _embed(self, texts: list[str]) -> np.ndarray:
        """Vectors comparable with the stored ones: where the embedding service now runs another encoder
        (``memory.embedding_model`` changed, and that service restarted) every stored text is embedded again
        first."""
        vectors, encoder = self._embed_batch(texts)
        store = self.store
        if encoder == store.encoder:
            return vectors
        if store.encoder is None and store.dim in (None, vectors.shape[1]):
            store.record_encoder(encoder)  # a new database, or one from before encoders were named
        else:
            self._embed_again(encoder)
        return vectors

    def _embed_batch(self, texts: list[str]) -> tuple[np.ndarray, str]:
        try:
            return embed_naming_encoder(self.embedder, texts)
        except ServiceError as err:  # pass the embedding service's typed failure on, saying where it came from
            raise ProtocolError(err.code, f"embedding service: {err.message}")

    def _embed_again(self, encoder: str) -> None:
        """Every stored text embedded by ``encoder``, replacing the vectors at once when all are made."""
        rows = self.store.texts()
        self.log.info("memory_reembed_start", documents=len(rows), was=self.store.encoder or f"{self.store.dim} dims",
                      encoder=encoder)
        batch, vectors = self.config.memory.embedding_batch_size, []
        for start in range(0, len(rows), batch):
            made, by = self._embed_batch([text for _, text in rows[start:start + batch]])
            if by != encoder:
                raise ProtocolError(ErrorCode.BUSY, f"the embedding model changed from {encoder} to {by} "
                                    "while stored memories were embedded again; nothing was replaced, send again")
            vectors.append(made)
            self.log.info("memory_reembed_progress", done=min(start + batch, len(rows)), of=len(rows))
        self.store.replace_vectors(encoder, [rowid for rowid, _ in rows], np.concatenate(vectors) if vectors else None)
        self.log.info("memory_reembed_done", documents=len(rows), encoder=encoder, dim=self.store.dim)

    def _write(self, req: Request, items: list[tuple[str, str, dict]]) -> dict:
        collection = _require_name(req.body, "collection")
        t0 = time.perf_counter()
        vectors = self._embed([text for _, text, _ in items])
        t1 = time.perf_counter()
        self.store.upsert(collection, items, vectors)
        t2 = time.perf_counter()
        self.log.info("memory_upsert", request_id=req.id, collection=collection, count=len(items),
                      embed_ms=round((t1 - t0) * 1e3, 1), commit_ms=round((t2 - t1) * 1e3, 1))
        return {"ids": [doc_id for doc_id, _, _ in items], "committed": True}

    def on_upsert(self, req: Request, _: Emitter) -> dict:
        body = req.body
        return self._write(req, [(_require_name(body, "id"), _require_name(body, "text"),
                                  _metadata(body.get("metadata"), ""))])

    def on_upsert_many(self, req: Request, _: Emitter) -> dict:
        items, seen = [], set()
        for i, item in enumerate(req.body["items"]):
            where = f"items[{i}]."
            if not isinstance(item, dict) or not all(isinstance(item.get(k), str) and item[k].strip()
                                                     for k in ("id", "text")):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where[:-1]} must be a map with non-empty 'id', 'text'")
            if len(item["id"]) > 256 or len(item["text"]) > 1 << 16:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}id over 256 or text over 64 Ki chars")
            if item["id"] in seen:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where}id {item['id']!r} repeats in the batch")
            seen.add(item["id"])
            items.append((item["id"], item["text"], _metadata(item.get("metadata"), where)))
        if not items:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "items must not be empty")
        return self._write(req, items)

    def on_delete(self, req: Request, _: Emitter) -> dict:
        deleted = self.store.delete(_require_name(req.body, "collection"), _require_name(req.body, "id"))
        self.log.info("memory_delete", request_id=req.id, id=req.body["id"], deleted=deleted)
        return {"deleted": deleted}

    def on_query(self, req: Request, _: Emitter) -> dict:
        body = req.body
        collection = _require_name(body, "collection")
        k = self.config.memory.default_k if body.get("k") is None else body["k"]
        if not 1 <= k <= _MAX_K:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"k must be in 1..{_MAX_K}")
        text, vector = body.get("text"), body.get("vector")
        if (text is None) == (vector is None):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "give exactly one of 'text' or 'vector'")
        if body.get("hybrid") and text is None:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "hybrid queries need 'text' (keywords come from it)")
        t0 = time.perf_counter()
        if text is not None:
            query_vector = self._embed([_require_name(body, "text")])[0]
        elif not vector or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in vector):
            raise ProtocolError(ErrorCode.BAD_REQUEST, "vector must be a non-empty list of numbers")
        else:
            query_vector = np.asarray(vector, dtype=np.float32)
            if not np.isfinite(query_vector).all():
                raise ProtocolError(ErrorCode.BAD_REQUEST, "vector must be finite")
        hits = self.store.query(collection, query_vector, k, body.get("filter"),
                                keyword_text=text if body.get("hybrid") else None,
                                keyword_weight=self.config.memory.hybrid_weight)
        ms = round((time.perf_counter() - t0) * 1e3, 2)
        self.log.debug("memory_query", request_id=req.id, collection=collection, k=k, hits=len(hits), ms=ms)
        return {"hits": hits, "ms": ms}
