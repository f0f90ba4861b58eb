"""Where speculative decoding's draft tokens come from.

* ``prompt_lookup`` - the tokens that followed the latest n-gram where it occurred
  before in the same sequence (llama-cpp-python's ``LlamaPromptLookupDecoding``).
  Free, and right surprisingly often on agent output, which repeats its context:
  tool-call JSON in a fixed shape, code echoed back, ids and paths.
* ``DraftModel`` - a small model with the target's vocabulary continues the
  sequence greedily. It keeps one mirror sequence per target sequence in its own
  context and evaluates only what changed since its last proposal, so each token
  costs it one small decode.

The target model checks every draft in its next decode step (``scheduler.Scheduler``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import llama_cpp
import numpy as np
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

from services.inference.sessions import common_prefix_len
from shared.config import EngineConfig

if TYPE_CHECKING:
    from services.inference.engine import Engine


def prompt_lookup(history: list[int], k: int, ngram_size: int) -> list[int]:
    """Up to ``k`` tokens that followed the last ``ngram_size`` tokens of ``history`` where they occurred before."""
    lookup = LlamaPromptLookupDecoding(max_ngram_size=ngram_size, num_pred_tokens=k)
    return [int(t) for t in lookup(np.array(history, dtype=np.intc))]


class DraftModel:
    def __init__(self, engine: "Engine", target_vocab_size: int):
        """``engine`` runs the draft model (its own context, one sequence per target sequence)."""
        self.engine = engine
        if engine.model.n_vocab() != target_vocab_size:
            engine.close()
            raise ValueError(f"draft model {engine.model_path} has {engine.model.n_vocab()} tokens in its vocabulary, "
                             f"the model it drafts for {target_vocab_size}: they must share one tokenizer")
        self._mirrors: dict[int, list[int]] = {}  # target seq id -> tokens whose KV this model holds there

    @property
    def memory_bytes(self) -> int:
        return self.engine.memory_bytes

    def propose(self, seq_id: int, history: list[int], k: int) -> list[int]:
        """This model's greedy continuation of ``history`` (up to ``k`` tokens, stopping at end-of-generation)."""
        engine = self.engine
        mirror = self._mirrors.setdefault(seq_id, [])
        keep = min(common_prefix_len(mirror, history), len(history) - 1)  # re-evaluate at least the last token
        llama_cpp.llama_memory_seq_rm(engine.ctx.memory, seq_id, keep, -1)
        del mirror[keep:]
        engine.evaluate(history[keep:], keep, seq_id)
        mirror.extend(history[keep:])
        drafts: list[int] = []
        n_vocab = engine.model.n_vocab()
        while len(drafts) < k:
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(engine.ctx.ctx, -1), shape=(n_vocab,))
            token = int(logits.argmax())
            if llama_cpp.llama_vocab_is_eog(engine.model.vocab, token):
                break
            drafts.append(token)
            if len(drafts) < k:
                engine.evaluate([token], len(mirror), seq_id)
                mirror.append(token)
        return drafts

    def reconfigure(self, cfg: EngineConfig) -> None:
        if self.engine.reconfigure(cfg):
            self._mirrors.clear()  # a rebuilt context holds no KV

    def close(self) -> None:
        self.engine.close()

