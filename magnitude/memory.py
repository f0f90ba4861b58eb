"""Client helpers for the memory services: ``embed`` vectors and a ``MemoryClient`` for retrieval."""

from __future__ import annotations

from shared.client import Client
from shared.codecs import embed
from shared.config import Config

__all__ = ["MemoryClient", "embed"]


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
