"""Context budget: fit the system prompt, retrieved memories and a chat history into the model's n_ctx.

Each part gets a share of ``n_ctx - reserve_output`` (``memory.budget``: system
~18%, retrieved memories ~20%, the goal up to 25%, the conversation the rest). Older turns that no
longer fit are **summarized** by the chat model, not dropped, and the original
turns are written verbatim to long-term memory, so nothing said is lost.

The manager does no I/O itself (the sans-I/O pattern of the agent loop):
``build`` is a generator that yields ``Count``, ``Summarize`` and ``Remember``
operations and receives their results, so the blocking and the asyncio agent
drive the same logic, and tests drive it with plain functions (``drive``).

Summaries are made with head-room (the kept turns fill half of what they may
use), so the next steps append to an unchanged prompt and the session's KV
cache keeps being reused until the budget is reached again.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Generator, Sequence

from shared.config import ContextBudget

SUMMARY_HEADING = "Summary of the earlier conversation:\n"
MEMORY_HEADING = "Relevant memories:\n"
#: Tokens a chat template adds around each message (role markers, end of turn).
MESSAGE_OVERHEAD = 6


@dataclass(frozen=True)
class Turn:
    """One chat message of the history; ``text`` is what is counted, summarized and remembered."""

    role: str  # "user", "assistant" or "tool"
    text: str
    id: str | None = None  # stable id for long-term memory; default: a hash of role and text
    message: dict | None = None  # the chat message sent (tool calls, tool_call_id); default {role, content: text}
    #: The agent's own prompting (a working-memory note, a repeated call and its result): in the run's prompt, but
    #: not in the conversation a next turn goes on, which is what a client re-sending it would send.
    note: bool = False

    @property
    def key(self) -> str:
        return self.id or "turn-" + hashlib.sha1(f"{self.role}\0{self.text}".encode()).hexdigest()[:16]

    def as_message(self) -> dict:
        return self.message if self.message is not None else {"role": self.role, "content": self.text}

    def with_text(self, text: str) -> "Turn":
        """The same turn (same key) with its text and message content replaced by ``text``."""
        message = None if self.message is None else {**self.message, "content": text}
        return Turn(self.role, text, self.key, message, self.note)


@dataclass(frozen=True)
class Count:
    """Operation: the number of tokens of ``text`` under the chat model's tokenizer (reply: int)."""
    text: str


@dataclass(frozen=True)
class Summarize:
    """Operation: a summary of ``turns`` in at most ``max_tokens`` tokens (reply: str)."""
    turns: tuple[Turn, ...]
    max_tokens: int


@dataclass(frozen=True)
class Remember:
    """Operation: write ``turns`` verbatim to long-term memory (reply ignored)."""
    turns: tuple[Turn, ...]


Operation = Count | Summarize | Remember


@dataclass
class BuiltPrompt:
    messages: list[dict]
    usage: dict[str, int]  # tokens per part, template overhead, total, budget and n_ctx
    summary: str | None = None
    summarized_turns: int = 0  # turns represented by the summary instead of verbatim
    kept_turns: int = 0
    dropped_memories: int = 0  # memories that did not fit their share


def translate(build: Generator, answer: Callable[[Any], Generator[Any, Any, Any]]) -> Generator:
    """Run ``build``, answering each of its operations with ``yield from answer(op)``; its return value.

    The agent answers the budget's operations with service requests this way, staying sans-I/O itself.
    """
    reply = None
    while True:
        try:
            op = build.send(reply)
        except StopIteration as done:
            return done.value
        reply = yield from answer(op)


def drive(build: Generator, handle: Callable[[Any], Any]) -> Any:
    """Run ``build`` to the end with a plain function answering each operation (tests, scripts)."""
    def answer(op: Any) -> Generator:
        return handle(op)
        yield  # a generator that answers at once

    try:
        next(translate(build, answer))
    except StopIteration as done:
        return done.value
    raise AssertionError("a plain handler never yields")


class ContextManager:
    """Builds chat messages within budget; keeps a rolling summary across the steps of one conversation.

    ``overhead``: tokens the template adds beyond the messages (tool definitions, its own system text);
    ``observe`` raises it to what the model really counted, so later prompts stay under n_ctx.
    """

    def __init__(self, n_ctx: int, budget: ContextBudget | None = None, summary_max_tokens: int = 128,
                 overhead: int = 0):
        if n_ctx < 32:
            raise ValueError(f"n_ctx must be >= 32, got {n_ctx}")
        self.n_ctx = n_ctx
        self.budget = budget or ContextBudget()
        # A reply reserve bigger than half the window would leave no prompt: cap it.
        self.available = n_ctx - min(self.budget.reserve_output, n_ctx // 2)
        self.summary_max_tokens = summary_max_tokens
        self.overhead = overhead
        self._cache: dict[str, int] = {}
        self._covered: list[str] = []  # keys of turns the current summary stands for, oldest first
        self._summary: str | None = None

    # --- counting (each is a generator: ``n = yield from self.count(text)``) ---------------------
    def count(self, text: str) -> Generator[Operation, Any, int]:
        if text not in self._cache:
            self._cache[text] = (yield Count(text)) if text else 0
        return self._cache[text]

    def fit(self, text: str, limit: int) -> Generator[Operation, Any, str]:
        """The longest prefix of ``text`` within ``limit`` tokens (binary search over characters)."""
        if (yield from self.count(text)) <= limit:
            return text
        lo, hi = 0, len(text)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (yield from self.count(text[:mid])) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return text[:lo]

    def _cost(self, turns: Sequence[Turn]) -> Generator[Operation, Any, int]:
        total = 0
        for turn in turns:
            total += (yield from self.count(turn.text)) + MESSAGE_OVERHEAD
        return total

    def _take(self, items: Sequence[str], limit: int, heading: str) -> Generator[Operation, Any, tuple[str, int]]:
        """Join as many items as fit under ``heading`` (in order); the text and how many were left out."""
        text = ""
        for i, item in enumerate(items):
            candidate = (text or heading) + f"- {item}\n"
            if (yield from self.count(candidate)) > limit:
                if i == 0:  # a single oversized item is cut rather than lost
                    return (yield from self.fit(candidate, limit)), len(items) - 1
                return text, len(items) - i
            text = candidate
        return text, 0

    # --- the prompt ------------------------------------------------------------------------------
    def build(self, system: str, goal: str, turns: Sequence[Turn], *, memories: Sequence[str] = (),
              compress: bool = False) -> Generator[Operation, Any, BuiltPrompt]:
        """Messages for the next model turn: the system prompt, the goal, then the history ``turns``.

        The system message stays the same from run to run, so a session reuses its KV (the template puts
        the tools right after it); the recalled ``memories`` and the summary of old turns go into the first
        user message, before the goal, which is always kept verbatim. ``compress``: summarize down to the
        low-water mark now, even if everything fits (the optimizer advised it: decoding slowed down).
        """
        avail, b = self.available, self.budget
        system_text = yield from self.fit(system, int(avail * b.system))
        memory_text, dropped = yield from self._take(list(memories), int(avail * b.retrieved), MEMORY_HEADING)
        goal_text = yield from self.fit(goal, avail // 4)
        fixed = (self.overhead + (yield from self.count(system_text)) + (yield from self.count(memory_text))
                 + (yield from self.count(goal_text)) + 2 * MESSAGE_OVERHEAD)
        recent_limit = max(avail - fixed, 0)
        originals = {t.key: t for t in turns}  # what is remembered is the turn as said, not its cut copy
        turns = yield from self._cut_all(turns, recent_limit // 2)

        keys = [t.key for t in turns]
        covered = len(self._covered) if self._covered and keys[:len(self._covered)] == self._covered else 0
        summary = self._summary if covered else None
        kept = turns[covered:]
        summary_cost = (yield from self.count(SUMMARY_HEADING + summary)) if summary else 0
        if compress or summary_cost + (yield from self._cost(kept)) > recent_limit:
            # Summarize down to the low-water mark, so the next steps append to an unchanged prompt.
            room = min(self.summary_max_tokens, recent_limit // 3)
            low_water = (recent_limit - room) // (4 if compress else 2)
            kept = yield from self._newest_that_fit(turns, low_water, recent_limit - room)
            overflow = turns[:len(turns) - len(kept)]
            if overflow:
                summary = yield from self._summary_for(overflow, max(room - (yield from self.count(SUMMARY_HEADING)), 1),
                                                       originals)
        summary_text = SUMMARY_HEADING + summary if summary else ""

        first = "\n\n".join(p.strip() for p in (memory_text, summary_text, goal_text) if p)
        messages = [{"role": "system", "content": system_text}, {"role": "user", "content": first},
                    *(t.as_message() for t in kept)]
        parts = {"system": (yield from self.count(system_text)), "retrieved": (yield from self.count(memory_text)),
                 "summary": (yield from self.count(summary_text)), "goal": (yield from self.count(goal_text)),
                 "recent": (yield from self._cost(kept))}
        template = self.overhead + 2 * MESSAGE_OVERHEAD
        usage = {**parts, "template": template, "total": sum(parts.values()) + template, "budget": avail,
                 "n_ctx": self.n_ctx}
        return BuiltPrompt(messages, usage, summary, len(turns) - len(kept), len(kept), dropped)

    def observe(self, built: BuiltPrompt, prompt_tokens: int) -> None:
        """Learn the template's real overhead from the tokens the model counted for ``built``."""
        self.overhead = max(self.overhead, self.overhead + prompt_tokens - built.usage["total"])

    def _cut_all(self, turns: Sequence[Turn], limit: int) -> Generator[Operation, Any, list[Turn]]:
        """Turns whose text alone exceeds ``limit`` tokens are cut to it, with a note (a huge tool output)."""
        out = []
        for turn in turns:
            if (yield from self.count(turn.text)) > limit:
                turn = turn.with_text((yield from self.fit(turn.text, max(limit - 8, 0))) + " [cut to fit the context]")
            out.append(turn)
        return out

    def _newest_that_fit(self, turns: list[Turn], limit: int, hard_limit: int) -> Generator[Operation, Any, list[Turn]]:
        """Newest turns within ``limit``, extended back to the call of a leading tool result while they stay
        within ``hard_limit`` (a result without its call reads as noise); at least the newest turn."""
        kept: list[Turn] = []
        used = 0
        for turn in reversed(turns):
            cost = yield from self._cost([turn])
            if kept and (used + cost > hard_limit or (used + cost > limit and kept[-1].role != "tool")):
                break
            kept.append(turn)
            used += cost
        kept.reverse()
        while len(kept) > 1 and kept[0].role == "tool":
            kept.pop(0)
        return kept

    def _summary_for(self, overflow: list[Turn], max_tokens: int,
                     originals: dict[str, Turn]) -> Generator[Operation, Any, str]:
        """Summary of ``overflow``: extend the rolling summary when only newer turns were added."""
        keys = [t.key for t in overflow]
        if keys == self._covered and self._summary is not None:
            return self._summary
        if self._summary is not None and keys[:len(self._covered)] == self._covered:
            new = overflow[len(self._covered):]
            source = [Turn("summary", self._summary)] + new
        else:
            new, source = overflow, overflow
        if new:
            yield Remember(tuple(originals[t.key] for t in new))
        text = yield Summarize(tuple(source), max_tokens)
        self._summary = yield from self.fit(text.strip(), max_tokens)
        self._covered = keys
        return self._summary


def transcript(turns: Sequence[Turn]) -> str:
    """Turns as plain lines for a summarizer: ``User: ...``, ``Tool: ...``."""
    names = {"user": "User", "assistant": "Assistant", "tool": "Tool", "summary": "Earlier"}
    return "\n".join(f"{names.get(t.role, t.role)}: {t.text}" for t in turns)


def turn_text(message: dict) -> str:
    """What of a chat message is counted and remembered: its content and its tool calls."""
    calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
    return " ".join([message.get("content") or "", *calls]).strip() or json.dumps(message)
