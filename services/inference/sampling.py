"""Token sampling with an optional grammar, checked the cheap way first.

Applying a GBNF grammar to every one of the vocabulary's 262k candidates at each
step made constrained decoding 2.6x slower. llama.cpp's own common sampler does
this instead, and so do we: sample from the plain chain, ask the grammar about
that one token, and only when the grammar rejects it apply the grammar to the
whole vocabulary and sample again. Constrained text is the same; most steps cost
one grammar check.
"""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np
from llama_cpp import _internals

from shared.grammar import check_grammar
from shared.protocol import ErrorCode, ProtocolError


class TokenSampler:
    def __init__(self, model: _internals.LlamaModel, ctx: _internals.LlamaContext, *, temperature: float,
                 top_k: int, top_p: float, seed: int, grammar: str | None):
        self._model, self._ctx = model, ctx
        self._grammar = None
        if grammar:
            check_grammar(grammar)  # llama.cpp's parser would crash the process on some grammars
            # Called directly: llama.cpp returns NULL for a grammar it cannot parse.
            self._grammar = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
            if not self._grammar:
                raise ProtocolError(ErrorCode.BAD_REQUEST, "grammar does not parse (GBNF with a 'root' rule)")
        self._chain = _internals.LlamaSampler()
        if temperature <= 0:
            self._chain.add_greedy()
        else:
            self._chain.add_top_k(top_k)
            self._chain.add_top_p(top_p, 1)
            self._chain.add_temp(temperature)
            self._chain.add_dist(seed)
        self._one = (llama_cpp.llama_token_data * 1)()
        self._one_array = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._one, llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False)
        self._all: _internals.LlamaTokenDataArray | None = None

    def close(self) -> None:
        if self._grammar is not None:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()

    def _grammar_allows(self, token: int) -> bool:
        self._one[0].id, self._one[0].logit, self._one[0].p = token, 0.0, 0.0
        self._one_array.size, self._one_array.selected = 1, -1
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(self._one_array))
        return math.isfinite(self._one[0].logit)

    def _sample_constrained(self, batch_index: int) -> int:
        n_vocab = self._model.n_vocab()
        if self._all is None:
            self._all = _internals.LlamaTokenDataArray(n_vocab=n_vocab)
        logits = llama_cpp.llama_get_logits_ith(self._ctx.ctx, batch_index)
        self._all.copy_logits(np.ctypeslib.as_array(logits, shape=(n_vocab,)))
        candidates = self._all.candidates
        candidates.selected = -1
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(candidates))
        llama_cpp.llama_sampler_apply(self._chain.sampler, ctypes.byref(candidates))
        return int(self._all.candidates_data.id[candidates.selected])

    def sample(self, batch_index: int = -1) -> int:
        """The next token from the logits of one position of the last batch (default: its last)."""
        token = llama_cpp.llama_sampler_sample(self._chain.sampler, self._ctx.ctx, batch_index)
        if self._grammar is None:
            return token
        if not self._grammar_allows(token):
            token = self._sample_constrained(batch_index)
        llama_cpp.llama_sampler_accept(self._grammar, token)
        return token
