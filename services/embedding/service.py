"""The embedding process: batched sentence vectors from an embedding GGUF (all-MiniLM-L6-v2 by default).

It runs apart from inference so a large ingest never competes with generation
for the same worker, and apart from retrieval so a slow embed never blocks a
query's database work.
"""

from __future__ import annotations

import time

import numpy as np

from shared.codecs import vectors_to_body
from shared.config import Config
from shared.cores import stack_lease
from shared.protocol import MAX_MEMORY_TEXT_CHARS, ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service


class Embedder:
    """One llama.cpp context in embedding mode; texts past 512 tokens are truncated (BERT's limit)."""

    def __init__(self, config: Config):
        import llama_cpp

        mem = config.memory
        self.model_path = mem.resolved_embedding_model_path()
        if not self.model_path.is_file():
            raise FileNotFoundError(f"embedding model {self.model_path} not found; run scripts/setup")
        threads = mem.embedding_n_threads
        self.llm = llama_cpp.Llama(str(self.model_path), embedding=True, n_ctx=512, n_batch=512, n_ubatch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        self.batch_size = mem.embedding_batch_size
        self.dim = self.llm.n_embd()
        self.core_lease = stack_lease(config)  # one llama.cpp computation at a time, with inference

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """L2-normalised vectors, and the tokens they were computed from (after truncation)."""
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        tokens = 0
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start:start + self.batch_size]
            with self.core_lease:
                vectors, count = self.llm.embed(chunk, truncate=True, return_count=True)
            out[start:start + len(chunk)] = np.asarray(vectors, dtype=np.float32)
            tokens += count
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12), tokens

    def close(self) -> None:
        self.llm.close()
        self.core_lease.close()


class EmbeddingService(Service):
    name = "embedding"
    worker_threads = 1  # one llama.cpp context; batching inside a request is where the speed comes from

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.embedder = Embedder(config)
        self.handle("embed", self.on_embed)

    def health_details(self) -> dict:
        return {"model": self.embedder.model_path.stem, "model_path": str(self.embedder.model_path),
                "dim": self.embedder.dim}

    def close(self) -> None:
        self.embedder.close()

    def on_embed(self, req: Request, _: Emitter) -> dict:
        texts = req.body["texts"]
        if not texts:
            raise ProtocolError(ErrorCode.BAD_REQUEST, "texts must not be empty")
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"texts[{i}] must be a non-empty string")
            if len(text) > MAX_MEMORY_TEXT_CHARS:
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"texts[{i}] longer than {MAX_MEMORY_TEXT_CHARS} chars")
        t0 = time.perf_counter()
        vectors, tokens = self.embedder.embed(texts)
        self.log.debug("embed", request_id=req.id, count=len(texts), ms=round((time.perf_counter() - t0) * 1e3, 1))
        return {**vectors_to_body(vectors, self.shm_pool), "tokens": tokens}
