"""Constrained decoding with llguidance token masks: GBNF grammars, JSON schemas, and lazy tool-call grammars.

llama.cpp's GBNF sampler checks candidate tokens one by one against its grammar
stacks; measured here it halved decode speed. llguidance (the library behind
llama.cpp's ``LLAMA_LLGUIDANCE`` build, and vLLM's and SGLang's structured output)
walks a token trie with a lexer and an Earley parser and computes the whole mask in
microseconds. It also knows which tokens the grammar forces next ("fast-forward"):
those are appended without sampling and drafted into the same decode step.

A ``Constraint`` is one generation's state. It is either active from the first token
(``grammar``, ``response_format``, ``tool_choice: required``) or lazy: dormant, so
free text stays free, until one of its triggers matches the output (the model opens
a tool call); then the trigger's grammar takes over from the token where the match
starts, and the tokens written since are replayed into it.

Every grammar and schema is bounded (size, nesting) before anything compiles it:
a deeply nested grammar is a known way to crash recursive parsers.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import llama_cpp
import llguidance
import llguidance.llamacpp
import numpy as np
from llama_cpp import _internals
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from services.inference.patterns import check_patterns
from services.inference.grammar import check_grammar, gbnf_pieces
from shared.protocol import MAX_SCHEMA_BYTES, MAX_SCHEMA_DEPTH, ProtocolError, bad_request

#: llguidance's own limits, the second line of defence (its defaults allow grammars of 500k symbols).
_LIMITS = llguidance.LLParserLimits(max_grammar_size=200_000, step_max_items=50_000, max_lexer_states=100_000)
#: JSON as the templates render it (json.dumps defaults): canonical output re-renders byte-identically.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}



def check_schema(schema: Any, what: str = "schema") -> None:
    """Size, depth and patterns (``patterns.py``) of a JSON schema, before it is compiled or validated against."""
    if not isinstance(schema, dict):
        raise bad_request(f"{what} must be a JSON object")
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError, RecursionError):
        raise bad_request(f"{what} is not plain JSON") from None
    if size > MAX_SCHEMA_BYTES:
        raise bad_request(f"{what} is over {MAX_SCHEMA_BYTES // 1024} KiB")
    stack: list[tuple[dict | list, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise bad_request(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    check_patterns(schema, what)


def json_lark(schema: dict) -> str:
    """A Lark fragment (llguidance syntax) for JSON that validates against ``schema``, in the templates' style."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


class Vocabulary:
    """A model's tokenizer as llguidance sees it (built once per model: about a second for 150k tokens)."""

    def __init__(self, model: _internals.LlamaModel):
        vocab = model.vocab
        self.n_vocab = model.n_vocab()
        self.eog = [t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)]
        with warnings.catch_warnings():  # it calls a deprecated llama-cpp-python alias once per token
            warnings.simplefilter("ignore", DeprecationWarning)
            self.tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(vocab, eos_token=self.eog or None)
        self.eos = self.tokenizer.eos_token

    def piece(self, token: int) -> bytes:
        """A token's bytes, special tokens spelled out (``<tool_call>``)."""
        return self.tokenizer.decode_bytes([token])

    def single_special(self, text: str) -> int | None:
        """The token id when ``text`` is exactly one special token of this vocabulary (Qwen's ``<tool_call>``)."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        return ids[0] if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]) else None


_vocabularies: "weakref.WeakKeyDictionary[_internals.LlamaModel, Vocabulary]" = weakref.WeakKeyDictionary()
_vocab_lock = threading.Lock()


def vocabulary(model: _internals.LlamaModel) -> Vocabulary:
    with _vocab_lock:
        vocab = _vocabularies.get(model)
        if vocab is None:
            vocab = _vocabularies[model] = Vocabulary(model)
        return vocab


def compile_lark(lark: str, vocab: Vocabulary) -> str:
    """A validated llguidance grammar from Lark text; errors are the client's (bad_request)."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, vocab.tokenizer, limits=_LIMITS)
    if is_error:
        raise bad_request(f"grammar rejected: {messages[0][:300]}")
    return grammar


_OPTIONAL_ONE = re.compile(r"\(([A-Za-z][\w-]*)\)\?")
_OPTIONAL_CHAIN = re.compile(r"\(([A-Za-z][\w-]*) \1\{0,(\d+)\}\)\?")


def _flatten_optional_chains(text: str) -> str:
    """``(x (x (x)?)?)?`` as ``x{0,3}``: the same language, one nesting level instead of one per repetition
    (how llama-cpp-python's JSON-schema converter writes a string's maxLength). Literals are left alone."""
    def flatten(code: str) -> str:
        code = _OPTIONAL_ONE.sub(r"\1{0,1}", code)
        while True:
            flat = _OPTIONAL_CHAIN.sub(lambda m: f"{m.group(1)}{{0,{int(m.group(2)) + 1}}}", code)
            if flat == code:
                return code
            code = flat
    return "".join(flatten(piece) if code else piece for piece, code in gbnf_pieces(text))


def gbnf_constraint(text: str, model: _internals.LlamaModel) -> "Constraint | LlamaGrammar":
    """A constraint for a GBNF grammar (``generate``'s ``grammar``): llguidance's masks when it takes the grammar,
    else llama.cpp's own grammar sampler, the reference for GBNF, which also says whether it parses at all.
    llguidance's Lark front end stops at a few dozen nesting levels; the nesting llama-cpp-python's JSON-schema
    converter writes for bounded strings is flattened first, so the agent's Action grammar takes the first way."""
    check_grammar(text)
    vocab = vocabulary(model)
    try:
        return Constraint(vocab, compile_lark(any_to_lark(_flatten_optional_chains(text)), vocab))
    except (GbnfToLarkError, ProtocolError, RecursionError, ValueError, IndexError, KeyError):
        return LlamaGrammar(model, text)


@dataclass(frozen=True)
class Trigger:
    """When ``pattern`` matches the output (bytes), ``grammar`` constrains it from the match's start on."""

    pattern: re.Pattern[bytes]
    grammar: str


class Constraint:
    def __init__(self, vocab: Vocabulary, grammar: str | None = None, triggers: Sequence[Trigger] = (),
                 banned: Sequence[int] = ()):
        self.vocab = vocab
        self._matcher = self._new_matcher(grammar) if grammar else None
        self._triggers = list(triggers)
        self._banned = np.array(sorted(set(banned)), dtype=np.int64)
        self._bitmask = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
        self.tokens: list[int] = []  # every token accepted, EOS included: the generation's own record (chat keeps it)
        self._offsets: list[int] = []  # byte offset of each token in ``_text`` (kept while a trigger waits)
        self._text = bytearray()
        self.triggered_at: int | None = None  # byte offset where a lazy grammar took over
        self.gave_up: str | None = None  # why a triggered grammar could not take the output written so far
        # ``forced()`` since the last accepted token: the scheduler drafts them, the sampler asks again at that position
        self._forced: list[int] | None = None

    def _new_matcher(self, grammar: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.vocab.tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise bad_request(f"grammar rejected: {matcher.get_error()[:300]}")
        return matcher

    @property
    def active(self) -> bool:
        return self._matcher is not None

    @property
    def finished(self) -> bool:
        """The grammar is complete (or in an error state): nothing but the end of the generation can follow."""
        return self._matcher is not None and self._matcher.is_stopped()

    def forced(self) -> list[int]:
        """Tokens the grammar allows no alternative to, from here on."""
        if self._forced is None:
            m = self._matcher
            self._forced = m.compute_ff_tokens() if m is not None and not m.is_stopped() else []
        return self._forced

    def allows(self, token: int) -> bool:
        m = self._matcher
        if m is None:
            return not (self._banned.size and token in self._banned)
        return m.validate_tokens([token]) == 1

    def _allowed(self) -> np.ndarray:
        """One bool per vocabulary token: may it come next?"""
        m = self._matcher
        if m is None:
            allowed = np.ones(self.vocab.n_vocab, dtype=bool)
            allowed[self._banned] = False
            return allowed
        m.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        return np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[:self.vocab.n_vocab].astype(bool)

    def mask(self, logits: np.ndarray) -> None:
        """Set every disallowed token's logit to -inf, in place (a row of llama.cpp's logits)."""
        logits[~self._allowed()[:logits.shape[0]]] = -np.inf

    def restrict(self, candidates: llama_cpp.llama_token_data_array) -> None:
        """The same on a llama.cpp candidate array (what a sampler chain consumes)."""
        data = np.ctypeslib.as_array(candidates.data, shape=(candidates.size,))
        data["logit"][~self._allowed()[data["id"]]] = -np.inf

    def close(self) -> None:
        """Nothing native to free (the matcher is Python-owned); here for the sampler's constraint interface."""

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        self._forced = None
        if self._matcher is not None:
            self._matcher.consume_token(token)
            return
        if not self._triggers:
            return
        self._offsets.append(len(self._text))  # one per token while the triggers wait
        self._text += self.vocab.piece(token)
        for trigger in self._triggers:
            match = trigger.pattern.search(self._text)
            if match:
                self._activate(trigger, match.start())
                return

    def _activate(self, trigger: Trigger, start: int) -> None:
        self._triggers = []  # one take-over per generation, whatever happens
        self.triggered_at = start
        if start not in self._offsets:
            self.gave_up = "the call's opener starts inside a token"
            return
        matcher = self._new_matcher(trigger.grammar)
        if not matcher.consume_tokens(self.tokens[self._offsets.index(start):]):
            self.gave_up = f"the call written so far does not fit the tools' grammar: {matcher.get_error()[:200]}"
            return
        self._matcher = matcher


class LlamaGrammar:
    """llama.cpp's GBNF sampler behind the ``Constraint`` interface: for grammars llguidance cannot take.
    It checks one token cheaply, but a full mask walks the whole vocabulary through its grammar stacks."""

    finished: Literal[False] = False  # llama.cpp's grammar ends by allowing only EOS; the sampler then picks it

    def __init__(self, model: _internals.LlamaModel, grammar: str):
        self._model = model
        # Called directly: llama.cpp returns NULL for a grammar it cannot parse.
        self._grammar = llama_cpp.llama_sampler_init_grammar(model.vocab, grammar.encode(), b"root")
        if not self._grammar:
            raise bad_request("grammar does not parse (GBNF with a 'root' rule)")
        self._one = (llama_cpp.llama_token_data * 1)()
        self._one_array = llama_cpp.llama_token_data_array(
            data=ctypes.cast(self._one, llama_cpp.llama_token_data_p), size=1, selected=-1, sorted=False)
        self._all: _internals.LlamaTokenDataArray | None = None

    def close(self) -> None:
        if self._grammar:
            llama_cpp.llama_sampler_free(self._grammar)
            self._grammar = None

    def forced(self) -> list[int]:
        return []

    def allows(self, token: int) -> bool:
        # llama_cpp annotates id as a c_int32; ctypes stores the int in the struct field
        self._one[0].id, self._one[0].logit, self._one[0].p = token, 0.0, 0.0  # type: ignore[assignment]
        self._one_array.size, self._one_array.selected = 1, -1
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(self._one_array))
        return math.isfinite(self._one[0].logit)

    def restrict(self, candidates: llama_cpp.llama_token_data_array) -> None:
        llama_cpp.llama_sampler_apply(self._grammar, ctypes.byref(candidates))

    def mask(self, logits: np.ndarray) -> None:
        if self._all is None:
            self._all = _internals.LlamaTokenDataArray(n_vocab=logits.shape[0])
        self._all.copy_logits(logits)
        self._all.candidates.selected = -1
        self.restrict(self._all.candidates)
        logits[self._all.candidates_data.id] = self._all.candidates_data.logit

    def accept(self, token: int) -> None:
        llama_cpp.llama_sampler_accept(self._grammar, token)
