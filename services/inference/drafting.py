"""Where speculative decoding's draft tokens come from, and how many pay.

* ``NgramIndex`` - the tokens that followed the latest occurrence of the last
  n tokens (the longest n that occurred) anywhere in the session's context (its prompt with every tool
  output, and what it generated so far). Free, and right surprisingly often on
  agent output, which repeats its context: tool-call JSON in a fixed shape, code
  echoed back, ids and paths. The index is built incrementally (each token is
  indexed once), so a lookup costs one dict access however long the context.
* ``DraftModel`` - a small model with the target's vocabulary continues the
  sequence greedily. It keeps one mirror sequence per target sequence in its own
  context and evaluates only what changed since its last proposal, so each token
  costs it one small decode.
* ``DraftLength`` - how many of those drafts to verify this step. On a CPU a
  decode of 1 + k tokens costs far more than one of 1 token (1.5B, 2 threads:
  1.5x for k = 1, 3x for k = 8), so drafts pay only where they are mostly right.
  The length is chosen from this session's measured acceptance of drafts found
  by a match of the same length n (a long match is right far more often than a
  short one) and the model's measured step costs (``StepCosts``), 0 when no
  length beats plain decoding. A session's first estimate for a match length is what the
  model measured over every session (``MatchAcceptance``).
* ``DraftPolicy`` - all of that for one resident model, behind one call the scheduler makes per
  generation and step (``propose``) and one with what its step confirmed (``observe``); a generation's
  own part is its ``DraftState``.

The target model checks every draft in its next decode step (``scheduler.Scheduler``). A draft model runs on
an engine built beside the target's (``resident.ResidentModel``), seen here only as an ``Evaluator``: this
module never imports the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from services.inference.sessions import Slot, common_prefix_len
from shared.config import EngineConfig


class NgramIndex:
    """Where each n-gram of a growing token list last ended, for n from ``longest`` down to ``shortest``
    (llama.cpp's ngram-simple, kept incrementally, trying the longest match first)."""

    def __init__(self, longest: int, shortest: int = 2):
        self.sizes = range(longest, min(shortest, longest) - 1, -1)
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._tokens: list[int] = []
        self._indexed = 0  # how many of them are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index ``tokens``, a list that only grows between calls (a task's confirmed tokens): its new part."""
        self._tokens = tokens
        for n, ends in self._ends.items():
            for end in range(max(self._indexed + 1, n), len(tokens) + 1):
                ends[tuple(tokens[end - n:end])] = end
        self._indexed = len(tokens)

    def propose(self, tail: list[int], k: int) -> tuple[list[int], int]:
        """Up to ``k`` tokens to follow the indexed tokens and then ``tail``: what followed their last n tokens
        where those last occurred, for the longest n that occurred before; and that n (0: none did)."""
        for n in self.sizes:
            need = n - len(tail)
            end = self._ends[n].get(tuple((self._tokens[-need:] if need > 0 else []) + tail[-n:]))
            if end is not None:
                return (self._tokens[end:end + k] + tail)[:k], n
        return [], 0


class StepCosts:
    """Seconds a decode step takes by its number of tokens, measured (moving averages), for ``DraftLength``.

    A size never measured is interpolated between its measured neighbours; above the largest measured size
    it is extrapolated at a quarter of a one-token step per token: what a token up to 9 costs on 2 cores
    (1.5B and Gemma 270M; the first extra token costs 1.1-1.4x more, so a new length still gets tried and
    measured). A cheaper guess made every fresh engine verify long drafts that did not pay."""

    def __init__(self, largest: int = 64):
        self._s = [0.0] * (largest + 1)

    def observe(self, n_tokens: int, seconds: float) -> None:
        if 0 < n_tokens < len(self._s):
            old = self._s[n_tokens]
            self._s[n_tokens] = seconds if old == 0.0 else 0.8 * old + 0.2 * seconds

    def __call__(self, n_tokens: int) -> float:
        s = self._s
        n_tokens = min(max(n_tokens, 1), len(s) - 1)
        if s[n_tokens]:
            return s[n_tokens]
        below = next((i for i in range(n_tokens - 1, 0, -1) if s[i]), 0)
        above = next((i for i in range(n_tokens + 1, len(s)) if s[i]), 0)
        if not below:
            return s[above] if above else 0.0
        if not above:
            return s[below] + 0.25 * (s[1] or s[below]) * (n_tokens - below)
        return s[below] + (s[above] - s[below]) * (n_tokens - below) / (above - below)


class DraftLength:
    """The draft length that maximizes a session's expected tokens per second of decoding.

    Acceptance is modelled per token: each draft is right with chance ``p`` given the ones before it were,
    measured on this session's own drafts (recent ones weigh more), starting from ``prior``
    (``MatchAcceptance.start``). Steps without drafts drift ``p`` slowly back towards the prior, so a session
    that stopped drafting tries again later."""

    def __init__(self, prior: float = 0.5, decay: float = 0.9):
        self.prior, self.decay = prior, decay
        self._right = 2 * prior  # the prior as pseudo-counts: 2 drafts, 2 * prior of them right
        self._tries = 2.0

    @property
    def p(self) -> float:
        return self._right / self._tries

    def observe(self, drafted: int, accepted: int) -> None:
        self._right = self.decay * self._right + accepted
        self._tries = self.decay * self._tries + accepted + (accepted < drafted)

    def rest(self, keep: float = 0.97) -> None:
        """A step where no draft paid: forget a little (slowly: each retry costs a bigger step that loses)."""
        self._right = keep * self._right + (1 - keep) * 2 * self.prior
        self._tries = keep * self._tries + (1 - keep) * 2.0

    def choose(self, most: int, costs: StepCosts, batch: int, gaining: int) -> int:
        """Drafts for this session, at most ``most``, in a step that already holds ``batch`` tokens of which
        ``gaining`` bring a token each: the length whose (tokens gained) / (step seconds) is highest, if it
        beats no drafts by 5% (a closer call is within the measurements' noise)."""
        best, best_rate, expected, p = 0, 1.05 * gaining / (costs(batch) or 1.0), 0.0, self.p
        for k in range(1, most + 1):
            expected += p ** k
            rate = (gaining + expected) / (costs(batch + k) or 1.0)
            if rate > best_rate:
                best, best_rate = k, rate
        return best


class MatchAcceptance:
    """A model's measured acceptance of drafts by the length n of the match that found them, over every
    session: where a new session's ``DraftLength`` for n starts. Agent requests are short, and each starts a
    session's estimate afresh: at a fixed prior every request paid again for the short matches its workload
    gets wrong (the agent traces of scripts/bench/drafting.py ran at 0.97x of plain decoding that way).

    The start is (n - 1) / (n + 1), or lower where this model measured less. Drafts from a longer match are
    right more often, and short ones less than that guess said before (first drafts right: about 1 in 3
    from 2-token matches on the drafting benchmark's workloads, 9 in 10 from 6-token ones). Never higher:
    what paid on one workload (tool-call JSON repeats its short matches) need not on the next, and a wrong
    long draft costs up to two steps."""

    def __init__(self) -> None:
        self._by_n: dict[int, DraftLength] = {}

    @staticmethod
    def cap(n: int) -> float:
        return (n - 1) / (n + 1)

    def observe(self, n: int, drafted: int, accepted: int) -> None:
        self._by_n.setdefault(n, DraftLength(prior=self.cap(n))).observe(drafted, accepted)

    def start(self, n: int) -> DraftLength:
        """A session's estimate for matches of n tokens, from what this model measured so far."""
        measured = self._by_n.get(n)
        return DraftLength(prior=min(self.cap(n), measured.p) if measured else self.cap(n))


class Evaluator(Protocol):
    """What a draft model needs of the engine that runs it (``engine.Engine``): its own context, one sequence
    per target sequence."""

    def evaluate(self, tokens: list[int], pos0: int, seq_id: int) -> None: ...
    def trim_seq(self, seq_id: int, keep: int) -> None: ...
    def argmax(self) -> int: ...
    def is_end(self, token: int) -> bool: ...


class DraftModel:
    def __init__(self, evaluator: Evaluator):
        """``evaluator`` runs the draft model, which shares the target's vocabulary."""
        self.evaluator = evaluator
        self._mirrors: dict[int, list[int]] = {}  # target seq id -> tokens whose KV this model holds there

    def propose(self, seq_id: int, history: list[int], k: int) -> list[int]:
        """This model's greedy continuation of ``history`` (up to ``k`` tokens, stopping at end-of-generation)."""
        evaluator = self.evaluator
        mirror = self._mirrors.setdefault(seq_id, [])
        keep = min(common_prefix_len(mirror, history), len(history) - 1)  # re-evaluate at least the last token
        evaluator.trim_seq(seq_id, keep)
        del mirror[keep:]
        evaluator.evaluate(history[keep:], keep, seq_id)
        mirror.extend(history[keep:])
        drafts: list[int] = []
        while len(drafts) < k:
            token = evaluator.argmax()
            if evaluator.is_end(token):
                break
            drafts.append(token)
            if len(drafts) < k:
                evaluator.evaluate([token], len(mirror), seq_id)
                mirror.append(token)
        return drafts

    def forget(self) -> None:
        """Its engine's context was rebuilt: it holds no KV any more."""
        self._mirrors.clear()


@dataclass
class DraftState:
    """One generation's drafting: its context's n-grams, its acceptance by match length, and its figures."""

    ngrams: NgramIndex | None = None  # its context's n-grams, for drafting by lookup
    #: How many drafts pay, from its acceptance of drafts found by an n-gram match of each length n.
    lengths: dict[int, DraftLength] = field(default_factory=dict)
    match: int = 0  # the n-gram length this step's drafts were found with (0: none, or not by lookup)
    drafted: int = 0  # speculative draft tokens proposed
    accepted: int = 0  # ... and confirmed by the model


class DraftPolicy:
    """One resident model's drafting: where drafts come from (``spec_drafter``: lookup, or its ``DraftModel``),
    how many a generation verifies (``DraftLength``), and the acceptance it measured over every session."""

    def __init__(self, cfg: EngineConfig, model: DraftModel | None = None):
        self.cfg, self.model = cfg, model
        self.acceptance = MatchAcceptance()

    def propose(self, state: DraftState, slot: Slot, tail: list[int], room: int, costs: StepCosts, batch: int,
                gaining: int) -> list[int]:
        """Up to ``room`` speculative tokens to follow ``slot``'s tokens and then ``tail`` (the pending token and
        any forced ones), at most ``spec_draft_tokens``; by lookup, as many as the generation's measured
        acceptance says pay in a step of ``batch`` tokens of which ``gaining`` bring a token each."""
        state.match = 0
        k = min(self.cfg.spec_draft_tokens, room)
        if k <= 0:
            return []
        if self.cfg.spec_drafter == "model":
            return self.model.propose(slot.seq_id, slot.tokens + tail, k)
        if state.ngrams is None:
            state.ngrams = NgramIndex(self.cfg.spec_ngram_size)
        state.ngrams.extend(slot.tokens)
        drafts, state.match = state.ngrams.propose(tail, k)
        if not drafts:
            return []
        length = state.lengths.get(state.match)
        if length is None:  # its first match of n tokens: start from what this model measured
            length = state.lengths[state.match] = self.acceptance.start(state.match)
        k = length.choose(len(drafts), costs, batch, gaining)
        if not k:
            length.rest()
        return drafts[:k]

    def observe(self, state: DraftState, drafted: int, accepted: int) -> None:
        """``accepted`` of the ``drafted`` speculative tokens ``propose`` gave this step were right."""
        state.drafted += drafted
        state.accepted += accepted
        if drafted and state.match:
            state.lengths[state.match].observe(drafted, accepted)
            self.acceptance.observe(state.match, drafted, accepted)
