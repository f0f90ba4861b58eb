"""Client helpers for the memory services: ``embed`` vectors and a ``MemoryClient`` for retrieval.

Vectors travel as raw float32 bytes (``vectors`` + ``shape``) when small, and as a
shared-memory array handle (``vectors_shm``) when the batch is over
``shm.INLINE_LIMIT_BYTES``; ``vectors_from_body`` reads either.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from magnitude.client import Client
from shared import shm
from shared.config import Config
from shared.protocol import ErrorCode, ProtocolError


def vectors_to_body(vectors: np.ndarray, pool: shm.ShmPool | None) -> dict[str, Any]:
    """Reply body for a (n, dim) float32 matrix: inline bytes, or an shm handle when large."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.nbytes > shm.INLINE_LIMIT_BYTES:
        return {"vectors_shm": shm.put_array(vectors, pool), "dim": int(vectors.shape[1])}
    return {"vectors": vectors.tobytes(), "shape": list(vectors.shape), "dim": int(vectors.shape[1])}


def vectors_from_body(body: dict[str, Any]) -> np.ndarray:
    if "vectors_shm" in body:
        return shm.take_array(body["vectors_shm"])
    try:
        return np.frombuffer(body["vectors"], dtype=np.float32).reshape(body["shape"]).copy()
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(ErrorCode.BAD_FRAME, "embed reply carries neither 'vectors' nor 'vectors_shm'")


def embed(client: Client, texts: list[str]) -> np.ndarray:
    """L2-normalised float32 vectors, one row per text, from the embedding service."""
    return vectors_from_body(client.request("embed", {"texts": texts}))


class MemoryClient:
    """Thin typed wrapper over the retrieval service's ``memory.*`` messages."""

    def __init__(self, client: Client):
        self.client = client

    @classmethod
    def for_config(cls, config: Config | None = None, timeout_s: float = 60.0) -> "MemoryClient":
        return cls(Client.for_service("retrieval", config, timeout_s=timeout_s))

    def upsert(self, collection: str, doc_id: str, text: str, metadata: dict | None = None) -> dict:
        return self.client.request("memory.upsert", {"collection": collection, "id": doc_id, "text": text,
                                                     "metadata": metadata or {}})

    def upsert_many(self, collection: str, items: list[dict]) -> dict:
        """``items``: maps with ``id``, ``text`` and optional ``metadata``; one embed call, one commit."""
        return self.client.request("memory.upsert_many", {"collection": collection, "items": items})

    def delete(self, collection: str, doc_id: str) -> bool:
        return self.client.request("memory.delete", {"collection": collection, "id": doc_id})["deleted"]

    def query(self, collection: str, text: str | None = None, vector: list[float] | None = None, k: int = 5,
              filter: dict | None = None, hybrid: bool = False) -> list[dict]:
        body = {"collection": collection, "text": text, "vector": vector, "k": k, "filter": filter,
                "hybrid": hybrid}
        return self.client.request("memory.query", {key: v for key, v in body.items() if v is not None})["hits"]

    def stats(self, collection: str | None = None) -> dict:
        return self.client.request("memory.stats", {"collection": collection} if collection else {})

    def close(self) -> None:
        self.client.close()
