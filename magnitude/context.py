"""Context budget manager: fit system prompt, tools, memories and history into the model's n_ctx.

Each part gets a share of ``n_ctx - reserve_output`` (``memory.budget`` in the
config: system ~18%, retrieved ~20%, tools and intermediate results the rest
after recent turns' ~40%); what a part leaves unused goes to the recent turns,
which are kept newest first. Older turns that no longer fit are **summarized**
by the chat model, not dropped, and the original turns are written to long-term
memory, so nothing said is lost. Tokens are counted with the model's own
tokenizer (the inference service's ``tokenize``), and the rendered prompt is
counted once more at the end, so the result never exceeds the budget.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Callable, Sequence

from shared.client import Client
from magnitude.prompts import gemma_prompt
from shared.config import ContextBudget

CountTokens = Callable[[str], int]
Summarize = Callable[[list["Turn"], int], str]
Remember = Callable[[list["Turn"]], None]

_SUMMARY_HEADING = "Summary of the earlier conversation:\n"
_MEMORY_HEADING = "Relevant memories:\n"
_TOOLS_HEADING = "Tools and results:\n"
_BOLD = re.compile(r"</?b>|\*\*")  # the small model likes to bold names


@dataclass(frozen=True)
class Turn:
    role: str  # "user" or "model"
    text: str
    id: str | None = None  # stable id for long-term memory; default: a hash of role and text

    @property
    def key(self) -> str:
        return self.id or "turn-" + hashlib.sha1(f"{self.role}\0{self.text}".encode()).hexdigest()[:16]


@dataclass
class BuiltPrompt:
    prompt: str
    usage: dict[str, int]  # tokens per part, plus template overhead, total, budget and n_ctx
    summary: str | None = None
    summarized_turns: int = 0  # turns represented by the summary instead of verbatim
    kept_turns: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # memories / tool items that did not fit


class ContextManager:
    """Builds prompts within budget; keeps a rolling summary across calls for one conversation."""

    def __init__(self, n_ctx: int, count_tokens: CountTokens, summarize: Summarize,
                 remember: Remember | None = None, budget: ContextBudget | None = None,
                 summary_max_tokens: int = 128, render: Callable[[list[tuple[str, str]]], str] = gemma_prompt):
        if n_ctx < 32:
            raise ValueError(f"n_ctx must be >= 32, got {n_ctx}")
        self.n_ctx = n_ctx
        self.budget = budget or ContextBudget()
        # A reply reserve bigger than half the window would leave no prompt: cap it.
        self.available = n_ctx - min(self.budget.reserve_output, n_ctx // 2)
        self.summary_max_tokens = summary_max_tokens
        self._count, self._summarize, self._remember, self._render = count_tokens, summarize, remember, render
        self._cache: dict[str, int] = {}
        self._covered: list[str] = []  # keys of turns the current summary stands for, oldest first
        self._summary: str | None = None

    def count(self, text: str) -> int:
        if text not in self._cache:
            self._cache[text] = self._count(text) if text else 0
        return self._cache[text]

    def fit(self, text: str, limit: int) -> str:
        """The longest prefix of ``text`` within ``limit`` tokens (binary search over characters)."""
        if self.count(text) <= limit:
            return text
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.count(text[:mid]) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo]

    def _take(self, items: Sequence[str], limit: int, heading: str) -> tuple[str, int]:
        """Join as many items as fit under ``heading`` (in order); return the text and how many were left out."""
        if not items:
            return "", 0
        text, used = "", 0
        for i, item in enumerate(items):
            candidate = (text or heading) + f"- {item}\n"
            if self.count(candidate) > limit:
                if i == 0:  # a single oversized item is cut rather than lost
                    return self.fit(candidate, limit), len(items) - 1
                return text, len(items) - used
            text, used = candidate, used + 1
        return text, 0

    def _summary_for(self, overflow: list[Turn], max_tokens: int) -> str:
        """Summary of ``overflow``: extend the rolling summary when only newer turns were added."""
        keys = [t.key for t in overflow]
        if keys == self._covered and self._summary is not None:
            return self._summary
        if self._summary is not None and keys[:len(self._covered)] == self._covered:
            new = overflow[len(self._covered):]
            source = [Turn("summary", self._summary)] + new
        else:
            new, source = overflow, overflow
        if self._remember and new:
            self._remember(new)
        self._summary = self.fit(self._summarize(source, max_tokens).strip(), max_tokens)
        self._covered = keys
        return self._summary

    def build(self, system: str, turns: Sequence[Turn], *, tools: Sequence[str] = (),
              memories: Sequence[str] = (), tool_results: Sequence[str] = ()) -> BuiltPrompt:
        """Prompt for the next model turn; ``turns`` is the whole history, the last one the current input."""
        if not turns:
            raise ValueError("build needs at least the current turn")
        avail, b = self.available, self.budget
        system_text = self.fit(system, int(avail * b.system))
        tools_limit = int(avail * (1 - b.system - b.recent - b.retrieved))
        # Definitions first; intermediate results newest first, so the freshest observation survives.
        tools_text, tools_dropped = self._take([*tools, *reversed(tool_results)], tools_limit, _TOOLS_HEADING)
        memory_text, memories_dropped = self._take(list(memories), int(avail * b.retrieved), _MEMORY_HEADING)

        turns = list(turns)
        while True:
            fixed = self.count(system_text) + self.count(tools_text) + self.count(memory_text)
            recent_limit = avail - fixed
            kept, used = self._newest_that_fit(turns, recent_limit)
            overflow = turns[:len(turns) - len(kept)]
            summary = None
            if overflow:
                room = min(self.summary_max_tokens, max(recent_limit - used, 0))
                if room < 8:  # make space for a useful summary by summarizing one more turn
                    kept, used = self._newest_that_fit(turns, recent_limit - min(self.summary_max_tokens,
                                                                                 recent_limit // 3))
                    overflow = turns[:len(turns) - len(kept)]
                    room = min(self.summary_max_tokens, max(recent_limit - used, 0))
                summary = self._summary_for(overflow, max(room - self.count(_SUMMARY_HEADING), 1))
            prompt = self._render_prompt(system_text, tools_text, memory_text, summary, kept)
            total = self.count(prompt)
            if total <= avail or not (memory_text or tools_text):
                break
            # Template tokens pushed it over: give up the lowest-priority part, then count again.
            if memory_text:
                memory_text, memories_dropped = "", len(memories)
            else:
                tools_text, tools_dropped = "", len(tools) + len(tool_results)
        if total > avail:  # only the current turn can still be too long: cut it to what is left
            last = kept[-1]
            over = total - avail
            kept[-1] = Turn(last.role, self.fit(last.text, max(self.count(last.text) - over - 4, 0)), last.id)
            prompt = self._render_prompt(system_text, tools_text, memory_text, summary, kept)
            total = self.count(prompt)
        parts = {"system": self.count(system_text), "tools": self.count(tools_text),
                 "retrieved": self.count(memory_text),
                 "summary": self.count(_SUMMARY_HEADING + summary) if summary else 0,
                 "recent": sum(self.count(t.text) for t in kept)}
        usage = {**parts, "template": total - sum(parts.values()), "total": total, "budget": avail,
                 "n_ctx": self.n_ctx}
        return BuiltPrompt(prompt, usage, summary, len(overflow), len(kept),
                           {"memories": memories_dropped, "tools": tools_dropped})

    def _newest_that_fit(self, turns: list[Turn], limit: int) -> tuple[list[Turn], int]:
        """Newest turns whose texts fit in ``limit`` (always at least the current one); and their tokens."""
        kept, used = [], 0
        for turn in reversed(turns):
            cost = self.count(turn.text) + 6  # the turn markers around each text
            if kept and used + cost > limit:
                break
            kept.append(turn)
            used += cost
        return kept[::-1], used

    def _render_prompt(self, system_text: str, tools_text: str, memory_text: str, summary: str | None,
                       kept: list[Turn]) -> str:
        head = "\n\n".join(p.strip() for p in (system_text, tools_text, memory_text,
                                                _SUMMARY_HEADING + summary if summary else "") if p)
        messages = [(t.role if t.role in ("user", "model") else "user", t.text) for t in kept]
        if messages and messages[0][0] == "user":  # Gemma has no system role: fold it into the first user turn
            messages[0] = ("user", f"{head}\n\n{messages[0][1]}" if head else messages[0][1])
        elif head:
            messages.insert(0, ("user", head))
        return self._render(messages)


def service_token_counter(inference: Client) -> CountTokens:
    """Count tokens with the chat model's real tokenizer, through the inference service."""
    return lambda text: len(inference.request("tokenize", {"text": text})["tokens"])


def model_summarizer(inference: Client, render: Callable[[list[tuple[str, str]]], str] = gemma_prompt) -> Summarize:
    """Summarize turns with the chat model itself (greedy, short).

    The transcript comes first and the reply is primed with "In this conversation,": asked the plain way,
    Gemma 3 270M echoes the instruction back instead of summarizing (seen here).
    """
    lead = "In this conversation,"

    def summarize(turns: list[Turn], max_tokens: int) -> str:
        names = {"user": "User", "model": "Assistant", "summary": "Earlier"}
        transcript = "\n".join(f"{names.get(t.role, t.role)}: {t.text}" for t in turns)
        prompt = render([("user", f"{transcript}\n\nSummarize the conversation above in one or two sentences, "
                                  "keeping names, places and numbers.")]) + lead
        text = inference.generate(prompt, max_tokens=max_tokens, temperature=0.0, stop=["\n"]).text
        return (lead + _BOLD.sub("", text)).strip()
    return summarize


def memory_writer(memory, collection: str, session: str | None = None) -> Remember:
    """Write summarized turns verbatim into long-term memory (a ``MemoryClient``); identical turns once."""
    def remember(turns: list[Turn]) -> None:
        unique = {t.key: t for t in turns}.values()
        memory.upsert_many(collection, [{"id": t.key, "text": t.text,
                                         "metadata": {"role": t.role, "session": session, "kind": "turn"}}
                                        for t in unique])
    return remember
