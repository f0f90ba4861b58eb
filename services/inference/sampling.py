"""Token sampling, optionally under a ``Constraint`` (grammar, JSON schema, lazy tool-call grammar).

The plain chain samples first and the constraint is asked about that one token;
only when it is refused are the disallowed logits masked (in place, in the
context's logits buffer) and the chain samples again. For greedy decoding that
is the same token a full mask would give; for sampling it is rejection sampling
from the masked distribution. Tokens the grammar forces are returned without
sampling at all.

Greedy sampling (temperature 0) is a numpy argmax over the logits row: 0.02 ms against
0.3 ms for ``llama_sampler_sample``, which first copies every logit into a candidate
array (it is the same token: the first of the highest logits).
"""

from __future__ import annotations

import llama_cpp
import numpy as np
from llama_cpp import _internals

from services.inference.constraint import Constraint, LlamaGrammar


class TokenSampler:
    def __init__(self, model: _internals.LlamaModel, ctx: _internals.LlamaContext, *, temperature: float,
                 top_k: int, top_p: float, seed: int, constraint: Constraint | LlamaGrammar | None = None):
        self._ctx = ctx
        self._n_vocab = model.n_vocab()
        self.constraint = constraint
        self._chain: _internals.LlamaSampler | None = None  # greedy: an argmax, no chain
        if temperature > 0:
            self._chain = _internals.LlamaSampler()
            self._chain.add_top_k(top_k)
            self._chain.add_top_p(top_p, 1)
            self._chain.add_temp(temperature)
            self._chain.add_dist(seed)

    def close(self) -> None:
        if self.constraint is not None:
            self.constraint.close()
        if self._chain is not None:
            self._chain.close()

    def forced(self) -> list[int]:
        """Tokens the constraint forces after the last sampled one: drafts that cannot be rejected."""
        return self.constraint.forced() if self.constraint is not None else []

    def _logits(self, batch_index: int) -> np.ndarray:
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx.ctx, batch_index),
                                     shape=(self._n_vocab,))

    def _pick(self, batch_index: int) -> int:
        if self._chain is None:
            return int(self._logits(batch_index).argmax())
        return llama_cpp.llama_sampler_sample(self._chain.sampler, self._ctx.ctx, batch_index)

    def sample(self, batch_index: int = -1) -> int:
        """The next token from the logits of one position of the last batch (default: its last)."""
        c = self.constraint
        if c is None:
            return self._pick(batch_index)
        forced = [c.vocab.eos] if c.finished else c.forced()
        if forced:
            token = forced[0]
        else:
            token = self._pick(batch_index)
            if not c.allows(token):
                c.mask(self._logits(batch_index))
                token = self._pick(batch_index)
        c.accept(token)
        return token
