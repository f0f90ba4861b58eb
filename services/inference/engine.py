"""Chat inference on llama.cpp through llama-cpp-python's low-level API.

One model, one context with ``session_slots`` sequences (per-sequence KV, like
llama.cpp's server slots). For each request the engine finds the longest prefix
of the new prompt already in the session's sequence, removes the rest of that
sequence, prefills only the new tokens in chunks, then samples token by token.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import llama_cpp
import psutil
from llama_cpp import _internals

from shared.config import KNOBS, REBUILD_KNOBS, EngineConfig
from shared.protocol import ErrorCode, ProtocolError
from services.inference.sampling import TokenSampler
from services.inference.drafting import DraftModel, prompt_lookup
from services.inference.sessions import Acquired, SessionTable, Slot, common_prefix_len
from services.inference.text_stream import TextStream

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


def _init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            llama_cpp.llama_backend_init()
            _backend_ready = True


@dataclass
class GenerateParams:
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 0.95
    top_k: int = 40
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    grammar: str | None = None
    constraint: Any = None  # a services.inference.constraint.Constraint (chat: tool calls, response_format)


class Engine:
    def __init__(self, cfg: EngineConfig):
        _init_backend()
        path = cfg.resolved_model_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} not found (run scripts/setup, or set engine.model_path)")
        self.model_path = path
        mparams = _internals.LlamaModel.default_params()
        mparams.use_mmap = True  # weights stay in the page cache, shared by every process mapping the file
        self.model = _internals.LlamaModel(path_model=str(path), params=mparams, verbose=False)
        self.model_name = self.model.metadata().get("general.name", path.stem)
        self.max_batch_seen = 0  # most generations decoded in one step so far
        self.cfg = cfg
        self._batch = None
        self._open_context()
        self.drafter = (DraftModel(Engine(self._draft_config(cfg)), self.model.n_vocab())
                        if cfg.draft_model_path else None)

    @staticmethod
    def _draft_config(cfg: EngineConfig) -> EngineConfig:
        return cfg.model_copy(update={"model_path": cfg.draft_model_path, "draft_model_path": None,
                                      "spec_drafter": "lookup", "spec_draft_tokens": 0})

    @property
    def memory_bytes(self) -> int:
        """Weights, plus KV state at full size, plus the draft model's: what the model slots budget counts."""
        own = self.model.size() + self._state_bytes
        return own + (self.drafter.memory_bytes if self.drafter else 0)

    def _open_context(self) -> None:
        """The llama.cpp context (one sequence per session slot), its batch and its session table."""
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
        self.sessions = SessionTable(cfg.session_slots, cfg.session_cache_mb * 2**20, self)
        #: generations one decode step can carry: one token each, in a batch of max_batch_size
        self.max_parallel = min(cfg.session_slots, cfg.max_batch_size)
        self._state_bytes = llama_cpp.llama_state_get_size(self.ctx.ctx)

    def _close_context(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.ctx.close()

    def close(self) -> None:
        if self.drafter:
            self.drafter.close()
        self._close_context()
        self.model.close()

    def busy(self) -> bool:
        return any(slot.busy for slot in self.sessions.slots)

    def settings(self) -> dict:
        """The tunable settings in force (n_threads resolved to the count actually used)."""
        current = {name: getattr(self.cfg, name) for name in KNOBS}
        current["n_threads"] = self.n_threads
        return current

    def reconfigure(self, cfg: EngineConfig) -> bool:
        """Apply new settings; rebuild the context when its size or KV type changes (True then).

        A rebuild forgets every session's cached KV (their next step prefills again), so the caller
        must only do it between requests."""
        rebuild = any(getattr(cfg, name) != getattr(self.cfg, name) for name in REBUILD_KNOBS)
        if rebuild and self.busy():
            raise ProtocolError(ErrorCode.BUSY, "cannot rebuild the context while a request is generating")
        self.cfg = cfg
        if rebuild:
            self._close_context()
            self._open_context()
        else:
            self.n_threads = cfg.n_threads or default_threads()
            llama_cpp.llama_set_n_threads(self.ctx.ctx, self.n_threads, self.n_threads)
        if self.drafter:
            self.drafter.reconfigure(self._draft_config(cfg))
        return rebuild

    # --- KvOps for SessionTable ------------------------------------------------------------
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

    def _decode(self, tokens: list[int], pos0: int, seq_id: int) -> None:
        """Evaluate ``tokens`` at positions ``pos0..`` in ``seq_id``, in prefill-sized chunks."""
        chunk = self.cfg.prefill_chunk_size
        batch = self._batch
        for start in range(0, len(tokens), chunk):
            part = tokens[start:start + chunk]
            batch.n_tokens = len(part)
            for i, tok in enumerate(part):
                batch.token[i] = tok
                batch.pos[i] = pos0 + start + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_id
                batch.logits[i] = 0
            batch.logits[len(part) - 1] = 1
            rc = llama_cpp.llama_decode(self.ctx.ctx, batch)
            if rc != 0:
                raise ProtocolError(ErrorCode.INTERNAL, f"llama_decode failed (rc={rc}; KV cache full?)")

    # --- the request path ------------------------------------------------------------------
    def start(self, prompt: str | list[int], session: str | None, params: GenerateParams,
              on_text: Callable[[str], None] | None = None) -> "Generation":
        """Prefill what the session's sequence lacks and sample the first token (``prompt``: text, or token ids
        already tokenized, as chat does to keep message contents apart from template markup)."""
        t_start = time.perf_counter()
        tokens = self.tokenize(prompt) if isinstance(prompt, str) else prompt
        n_ctx = self.cfg.n_ctx
        if len(tokens) >= n_ctx:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompt is {len(tokens)} tokens; n_ctx is {n_ctx}")
        sampler = TokenSampler(self.model, self.ctx, temperature=params.temperature, top_k=params.top_k,
                               top_p=params.top_p, seed=params.seed, grammar=params.grammar,
                               constraint=params.constraint)
        try:
            got = self.sessions.acquire(session)
        except ProtocolError:
            sampler.close()
            raise
        slot = got.slot
        g = Generation(slot, sampler, TextStream(params.stop), on_text, min(params.max_tokens, n_ctx - len(tokens)),
                       t_start, len(tokens), got)
        try:
            # Keep the shared prefix; at least the last prompt token is evaluated to get fresh logits.
            g.cached = min(common_prefix_len(slot.tokens, tokens), len(tokens) - 1)
            llama_cpp.llama_memory_seq_rm(self.ctx.memory, slot.seq_id, g.cached, -1)
            slot.tokens = tokens[:g.cached]
            new = tokens[g.cached:]
            t_prefill = time.perf_counter()
            self._decode(new, g.cached, slot.seq_id)
            slot.tokens.extend(new)
            g.prefill_s = time.perf_counter() - t_prefill
            g.t_decode = time.perf_counter()
            self._sample_next(g, -1)
        except Exception:
            g.finish(self.sessions, "error")
            raise
        return g

    def step(self, generations: list["Generation"]) -> None:
        """Decode the pending token of every unfinished generation in one batch, then sample each one's next.

        With ``spec_draft_tokens`` on, each generation also carries draft tokens looked up in its own
        context (prompt-lookup decoding: agent output often repeats what it has seen); the model checks
        them all in the same decode, and each draft that matches what the sampler picks is a token
        gained without a decode step of its own. Tokens a grammar forces are drafted the same way, whatever
        the setting, ahead of any speculative ones: they cannot be rejected (counted as ``forced_tokens``)."""
        active = [g for g in generations if not g.done]
        if not active:
            return
        self.max_batch_seen = max(self.max_batch_seen, len(active))
        room = self.cfg.max_batch_size - len(active)  # batch cells left for drafts
        batch = self._batch
        plan: list[tuple[Generation, int, list[int], int]] = []  # generation, first batch index, drafts, forced
        n = 0
        for g in active:
            limit = max(min(room, g.max_tokens - g.generated - 1), 0)
            forced = g.sampler.forced()[:limit]
            drafts = forced + self._draft(g, limit - len(forced), forced)
            room -= len(drafts)
            plan.append((g, n, drafts, len(forced)))
            pos = len(g.slot.tokens)
            for i, tok in enumerate([g.pending] + drafts):
                batch.token[n] = tok
                batch.pos[n] = pos + i
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = g.slot.seq_id
                batch.logits[n] = 1
                n += 1
        batch.n_tokens = n
        rc = llama_cpp.llama_decode(self.ctx.ctx, batch)
        if rc != 0:
            for g in active:
                g.finish(self.sessions, "error")
            raise ProtocolError(ErrorCode.INTERNAL, f"llama_decode failed (rc={rc}; KV cache full?)")
        for g, first, drafts, forced in plan:
            g.slot.tokens.append(g.pending)
            g.drafted += len(drafts) - forced
            for i in range(len(drafts) + 1):
                tok = self._sample_next(g, first + i)
                if g.done or i == len(drafts) or tok != drafts[i]:
                    break
                g.slot.tokens.append(tok)  # the draft was right: its KV is already in place
                if i < forced:
                    g.forced += 1
                else:
                    g.accepted += 1
            if drafts:  # drop the KV of rejected drafts (and of any past where the generation ended)
                llama_cpp.llama_memory_seq_rm(self.ctx.memory, g.slot.seq_id, len(g.slot.tokens), -1)

    def _draft(self, g: "Generation", limit: int, forced: list[int]) -> list[int]:
        """Up to ``spec_draft_tokens`` draft tokens to follow the generation's pending token (and the tokens its
        grammar forces after it)."""
        k = min(self.cfg.spec_draft_tokens, limit)
        if k <= 0:
            return []
        history = g.slot.tokens + [g.pending] + forced
        if self.cfg.spec_drafter == "model":
            return self.drafter.propose(g.slot.seq_id, history, k)
        return prompt_lookup(history, k, self.cfg.spec_ngram_size)

    def _sample_next(self, g: "Generation", batch_index: int) -> int:
        """Sample, stream and account one token; it becomes the pending one unless the generation ends."""
        tok = g.sampler.sample(batch_index)
        if g.ttft is None:
            g.ttft = time.perf_counter() - g.t_start
        if llama_cpp.llama_vocab_is_eog(self.model.vocab, tok):
            g.finish(self.sessions, "eos")
            return tok
        g.generated += 1
        g.emit(g.stream.feed(self.token_bytes(tok)))
        if g.stream.stopped:
            g.finish(self.sessions, "stop")
        elif g.generated >= g.max_tokens:
            g.finish(self.sessions, "length")
        else:
            g.pending = tok
        return tok

    def generate(self, prompt: str, session: str | None, params: GenerateParams,
                 on_text: Callable[[str], None] | None = None) -> dict:
        """One request on its own: start, then step until done."""
        g = self.start(prompt, session, params, on_text)
        while not g.done:
            self.step([g])
        return g.result()


@dataclass
class Generation:
    """One request in flight: its slot (held busy), sampler, text stream and counters."""

    slot: "Slot"
    sampler: TokenSampler
    stream: TextStream
    on_text: Callable[[str], None] | None
    max_tokens: int
    t_start: float
    prompt_tokens: int
    acquired: "Acquired"
    cached: int = 0
    generated: int = 0
    pending: int = -1  # sampled, not yet decoded
    drafted: int = 0  # speculative draft tokens proposed
    accepted: int = 0  # ... and confirmed by the model
    forced: int = 0  # tokens a grammar forced, decoded as drafts (not sampled)
    ttft: float | None = None
    prefill_s: float = 0.0
    t_decode: float = 0.0
    t_end: float = 0.0
    stop_reason: str | None = None
    model: str = ""  # the pool's name for the model (set by the service)
    model_load_ms: float = 0.0  # time spent loading that model for this request (0 when resident)
    chat: Any = None  # the chat turn that turns the result into an assistant message (set by the service)

    @property
    def done(self) -> bool:
        return self.stop_reason is not None

    def emit(self, piece: str) -> None:
        if piece and self.on_text:
            self.on_text(piece)

    def finish(self, sessions: SessionTable, reason: str) -> None:
        self.stop_reason = reason
        self.emit(self.stream.finish())
        self.t_end = time.perf_counter()
        self.sampler.close()
        sessions.release(self.slot)

    def result(self) -> dict:
        decode_s = self.t_end - self.t_decode
        total_s = self.t_end - self.t_start
        prefill = self.prompt_tokens - self.cached
        return {
            "text": self.stream.text,
            "stop_reason": self.stop_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached,
            "prefill_tokens": prefill,
            "completion_tokens": self.generated,
            "kv_source": self.acquired.source,
            "kv_switch_ms": self.acquired.switch_ms,
            "ttft_s": round(self.ttft if self.ttft is not None else total_s, 4),
            "prefill_tps": round(prefill / self.prefill_s, 1) if self.prefill_s > 0 else None,
            "decode_tps": round(self.generated / decode_s, 1) if self.generated and decode_s > 0 else None,
            "total_s": round(total_s, 4),
            "draft_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "forced_tokens": self.forced,
        }
