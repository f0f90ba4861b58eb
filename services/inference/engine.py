"""A thin wrapper of one llama.cpp model and its context, through llama-cpp-python's low-level API.

The context holds ``session_slots`` sequences, each with its own KV cells (``kv_unified`` off): a sequence
attends over its own cells only, so a step's cost does not grow with the other sessions' contexts (with one
unified buffer every token attended over all of them: 8 sequences of 700 tokens decoded 1.6x slower and a
256-token prompt chunk prefilled 2x slower, see docs/scheduler.md). Gemma 3's sliding-window layers get a
full-size cache (``swa_full``) so any prefix stays reusable.

What runs on it, and when, is the scheduler's business (``scheduler.py``): this module only evaluates a batch
of rows (``decode``), moves a sequence's KV in and out, tokenizes, and knows its settings. What the scheduler
keeps per model beside it (the session table, the drafting policy, a draft model's own engine) is
``resident.ResidentModel``'s; a draft model sees its engine only as a ``drafting.Evaluator``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import threading

import llama_cpp
import numpy as np
import psutil
from llama_cpp import _internals

from shared.config import KNOBS, REBUILD_KNOBS, EngineConfig
from shared.protocol import ErrorCode, ProtocolError

_KV_TYPES = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0, "q4_0": llama_cpp.GGML_TYPE_Q4_0}


def settings_id(settings: dict) -> str:
    """A short stable name for a set of settings, so telemetry and feedback can be grouped by it."""
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def default_threads() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@llama_cpp.llama_log_callback
def _quiet_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's own chatter would interleave with our JSON logs; keep only errors."""
    if level >= 4:  # GGML_LOG_LEVEL_ERROR
        os.write(2, text)


_backend_lock = threading.Lock()
_backend_ready = False


def init_backend() -> None:
    """llama.cpp's backend and quiet logging, once per process."""
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True


#: One row of a batch: (sequence id, position of its first token, its tokens, how many of its last tokens need logits).
Row = tuple[int, int, list[int], int]


class Engine:
    def __init__(self, cfg: EngineConfig, core_lease: contextlib.AbstractContextManager | None = None):
        """``core_lease``: held around every ``llama_decode`` (``shared.cores``; None: nothing to share with); a
        decode that cannot get it in time raises ``LeaseTimeout``, which fails its batch's requests ``busy``."""
        init_backend()
        self.core_lease = core_lease or contextlib.nullcontext()
        path = cfg.resolved_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} not found (run scripts/setup, or set engine.model_path)")
        self.model_path = path
        mparams = _internals.LlamaModel.default_params()
        mparams.use_mmap = True  # weights stay in the page cache, shared by every process mapping the file
        self.model = _internals.LlamaModel(path_model=str(path), params=mparams, verbose=False)
        self.model_name = self.model.metadata().get("general.name", path.stem)
        self.n_vocab = self.model.n_vocab()
        self.cfg = cfg
        self.warmed = False
        self._batch: llama_cpp.llama_batch | None = None
        self._open_context()

    @property
    def memory_bytes(self) -> int:
        """Weights, plus KV state at full size."""
        return self.model.size() + self._state_bytes

    def fingerprint(self) -> dict:
        """What a saved sequence state depends on: it is only loaded back into an engine with the same."""
        stat = self.model_path.stat()
        return {"model": {"path": str(self.model_path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns},
                "n_ctx": self.cfg.n_ctx, "kv_cache_type": self.cfg.kv_cache_type, "swa_full": True,
                "llama_cpp": llama_cpp.__version__}

    def _open_context(self) -> None:
        """The llama.cpp context (one sequence per session slot) and its batch."""
        cfg = self.cfg
        self.n_threads = cfg.n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx * cfg.session_slots
        cparams.n_seq_max = cfg.session_slots
        cparams.kv_unified = False  # each sequence attends over its own cells only
        cparams.swa_full = True  # Gemma 3 uses sliding-window layers; a full cache keeps any prefix reusable
        cparams.n_batch = cfg.max_batch_size
        cparams.n_ubatch = min(cfg.max_batch_size, 512)
        cparams.n_threads = self.n_threads
        cparams.n_threads_batch = self.n_threads
        cparams.type_k = cparams.type_v = _KV_TYPES[cfg.kv_cache_type]
        if cfg.kv_cache_type != "f16":
            cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED  # quantized V needs it
        self.ctx = _internals.LlamaContext(model=self.model, params=cparams, verbose=False)
        self._batch = llama_cpp.llama_batch_init(cfg.max_batch_size, 0, 1)
        self._state_bytes = llama_cpp.llama_state_get_size(self.ctx.ctx)

    def warm_up(self) -> None:
        """One throwaway decode, as llama-server does at start: it pages the mapped weights in and runs the
        kernels once, so the first request does not pay for that (about 0.3 s here).

        Call it from the thread that decodes, like every decode: llama.cpp's CPU backend runs on OpenMP, which
        keeps a thread pool per calling thread, and once there are more OpenMP threads than CPUs it stops
        spinning between parallel regions; a warm-up on the main thread made every later decode on the
        worker thread 25-30% slower (scripts/bench/batch_shapes.py, docs/scheduler.md)."""
        if not self.warmed:
            vocab = self.model.vocab
            self.decode([(0, 0, [llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)], 1)])
            self.clear_seq(0)
            self.warmed = True

    def _close_context(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.ctx.close()

    def close(self) -> None:
        self._close_context()
        self.model.close()

    def settings(self) -> dict:
        """The tunable settings in force (n_threads resolved to the count actually used)."""
        current = {name: getattr(self.cfg, name) for name in KNOBS}
        current["n_threads"] = self.n_threads
        return current

    def needs_rebuild(self, cfg: EngineConfig) -> bool:
        return any(getattr(cfg, name) != getattr(self.cfg, name) for name in REBUILD_KNOBS)

    def reconfigure(self, cfg: EngineConfig) -> bool:
        """Apply new settings; rebuild the context when its size or KV type changes (True then).

        A rebuild forgets every sequence's KV, so the caller must only do it while none is in use
        (``ResidentModel.reconfigure`` checks)."""
        rebuild = self.needs_rebuild(cfg)
        self.cfg = cfg
        if rebuild:
            self._close_context()
            self._open_context()
        else:
            self.n_threads = cfg.n_threads or default_threads()
            llama_cpp.llama_set_n_threads(self.ctx.ctx, self.n_threads, self.n_threads)
        return rebuild

    # --- KV of one sequence (sessions.KvOps) ---------------------------------------
    def save_seq(self, seq_id: int) -> bytes:
        size = llama_cpp.llama_state_seq_get_size(self.ctx.ctx, seq_id)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ctx.ctx, buf, size, seq_id)
        return ctypes.string_at(buf, written)  # one memcpy; slicing a ctypes array builds a list of ints

    def load_seq(self, seq_id: int, state: bytes) -> bool:
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        return llama_cpp.llama_state_seq_set_data(self.ctx.ctx, buf, len(state), seq_id) > 0

    def clear_seq(self, seq_id: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.ctx.memory, seq_id, -1, -1)

    def trim_seq(self, seq_id: int, keep: int) -> None:
        """Drop the KV of positions ``keep`` and later."""
        llama_cpp.llama_memory_seq_rm(self.ctx.memory, seq_id, keep, -1)

    # --- model primitives ------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text.encode(), add_bos=True, special=True)

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, False)
        if n < 0:  # piece longer than the buffer: llama.cpp reports the size it needs
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.model.vocab, token, buf, len(buf), 0, False)
        return buf.raw[:n]

    def is_end(self, token: int) -> bool:
        return llama_cpp.llama_vocab_is_eog(self.model.vocab, token)

    def decode(self, rows: list[Row]) -> list[int]:
        """Evaluate every row in ONE llama_decode; returns each row's first index in the batch (the index a
        sampler reads the logits of a token at). At most ``max_batch_size`` tokens in all.

        Rows should come in increasing sequence order: with one KV stream per sequence llama.cpp cuts the
        batch into equal-length sub-batches of consecutive sequence ids, and out of order it cuts more
        (4 decodes in order 38 ms, shuffled 52 ms here)."""
        batch = self._batch
        firsts = []
        n = 0
        for seq_id, pos0, tokens, n_logits in rows:
            firsts.append(n)
            first_logit = len(tokens) - n_logits
            for i, tok in enumerate(tokens):
                batch.token[n] = tok
                # llama_cpp annotates pos as an array of arrays; its field is POINTER(llama_pos), one int a token
                batch.pos[n] = pos0 + i  # type: ignore[call-overload]
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq_id
                batch.logits[n] = i >= first_logit
                n += 1
        batch.n_tokens = n
        with self.core_lease:
            rc = llama_cpp.llama_decode(self.ctx.ctx, batch)
        if rc != 0:
            raise ProtocolError(ErrorCode.INTERNAL, f"llama_decode failed (rc={rc}; KV cache full?)")
        return firsts

    def evaluate(self, tokens: list[int], pos0: int, seq_id: int) -> None:
        """Evaluate ``tokens`` of one sequence from ``pos0`` in batch-sized calls; logits of the last."""
        size = self.cfg.max_batch_size
        for start in range(0, len(tokens), size):
            part = tokens[start:start + size]
            self.decode([(seq_id, pos0 + start, part, 1 if start + size >= len(tokens) else 0)])

    def argmax(self) -> int:
        """The most likely token after the last one evaluated (greedy, as a draft model continues)."""
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self.ctx.ctx, -1), shape=(self.n_vocab,))
        return int(logits.argmax())
