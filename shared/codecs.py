"""How structured payloads travel in message bodies: embedding matrices, inline or through shared memory.

Vectors travel as raw float32 bytes (``vectors`` + ``shape``) when small, and as a
shared-memory array handle (``vectors_shm``) when the batch is over
``shm.INLINE_LIMIT_BYTES``; ``vectors_from_body`` reads either.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shared import shm
from shared.protocol import ErrorCode, ProtocolError

if TYPE_CHECKING:
    from shared.client import Client


def put_array(array: np.ndarray, pool: shm.ShmPool | None = None, session_id: str | None = None) -> dict:
    """Copy a numpy array into a new shm segment; the handle also carries dtype and shape."""
    array = np.ascontiguousarray(array)
    handle = shm.put_bytes(array.tobytes(), pool, session_id)
    return {**handle, "kind": "array", "dtype": array.dtype.str, "shape": list(array.shape)}


def take_array(handle: Any, session_id: str | None = None, max_bytes: int = shm.MAX_TAKE_BYTES) -> np.ndarray:
    """Read an array segment of at most ``max_bytes`` (copied out) and unlink it."""
    data = shm.take_bytes(handle, session_id, max_bytes)
    try:
        dtype = np.dtype(handle["dtype"])
        shape = tuple(int(d) for d in handle["shape"])
    except Exception:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm array handle needs a valid 'dtype' and 'shape'")
    if any(d < 0 for d in shape) or int(np.prod(shape)) * dtype.itemsize != len(data):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "shm array handle: shape and dtype do not match size")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def vectors_to_body(vectors: np.ndarray, pool: shm.ShmPool | None) -> dict[str, Any]:
    """Reply body for a (n, dim) float32 matrix: inline bytes, or an shm handle when large."""
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.nbytes > shm.INLINE_LIMIT_BYTES:
        return {"vectors_shm": put_array(vectors, pool), "dim": int(vectors.shape[1])}
    return {"vectors": vectors.tobytes(), "shape": list(vectors.shape), "dim": int(vectors.shape[1])}


def vectors_from_body(body: dict[str, Any]) -> np.ndarray:
    if "vectors_shm" in body:
        return take_array(body["vectors_shm"])
    try:
        return np.frombuffer(body["vectors"], dtype=np.float32).reshape(body["shape"]).copy()
    except (KeyError, TypeError, ValueError):
        raise ProtocolError(ErrorCode.BAD_FRAME, "embed reply carries neither 'vectors' nor 'vectors_shm'")


def embed(client: "Client", texts: list[str]) -> np.ndarray:
    """L2-normalised float32 vectors, one row per text, from the embedding service."""
    return embed_naming_encoder(client, texts)[0]


def embed_naming_encoder(client: "Client", texts: list[str]) -> tuple[np.ndarray, str]:
    """``embed``'s vectors and the encoder that made them: vectors of two encoders are not comparable, even of
    one size, so whoever stores them checks every batch's encoder."""
    body = client.request("embed", {"texts": texts})
    vectors = vectors_from_body(body)
    if not isinstance(body.get("model"), str):
        raise ProtocolError(ErrorCode.BAD_FRAME, "embed reply does not name its 'model'")
    return vectors, body["model"]
