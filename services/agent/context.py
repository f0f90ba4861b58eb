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

``WorkingMemory`` is a run's short record of what its tools gave: restated in
each step's prompt with what the task still needs (a file named but not yet
read), and the yardstick a candidate answer is checked against (no unread file,
no number that was neither given, read nor computed).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
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


#: A file path as tasks and files write them (``notes/bike.txt``, ``readings.csv``): a 2-5 letter extension.
PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.[A-Za-z][A-Za-z0-9]{1,4})(?![\w/])")
#: A number as written in text (``1,840``, ``-3``, ``0.35``); not the digits inside a word.
_NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
#: Characters of one tool result restated in the working memory.
FACT_CHARS = 240
#: Units a task may ask its answer in, by what they measure: each unit's spellings after a number.
_UNITS = {
    "length": {"millimetres": "mm millimetre millimetres millimeter millimeters",
               "centimetres": "cm centimetre centimetres centimeter centimeters",
               "metres": "m metre metres meter meters", "kilometres": "km kilometre kilometres kilometer kilometers",
               "inches": "inch inches", "feet": "ft foot feet", "miles": "mile miles"},
    "time": {"seconds": "s sec secs second seconds", "minutes": "min mins minute minutes",
             "hours": "h hr hrs hour hours", "days": "day days", "weeks": "week weeks"},
    "mass": {"grams": "g gram grams", "kilograms": "kg kilo kilos kilogram kilograms",
             "pounds": "lb lbs pound pounds", "ounces": "oz ounce ounces"},
    "volume": {"millilitres": "ml millilitre millilitres milliliter milliliters",
               "litres": "l litre litres liter liters", "gallons": "gallon gallons"},
    "temperature": {"Celsius": "c °c celsius", "Fahrenheit": "f °f fahrenheit"},
}
#: Each unit's size in its kind's base unit (metre, second, gram, litre), for the conversion a task needs.
_SIZE = {"millimetres": 0.001, "centimetres": 0.01, "metres": 1, "kilometres": 1000, "inches": 0.0254, "feet": 0.3048,
         "miles": 1609.344, "seconds": 1, "minutes": 60, "hours": 3600, "days": 86400, "weeks": 604800, "grams": 1,
         "kilograms": 1000, "pounds": 453.59237, "ounces": 28.349523125, "millilitres": 0.001, "litres": 1,
         "gallons": 3.785411784}
_TEMPERATURE = {("Fahrenheit", "Celsius"): "subtract 32, then multiply by 5 / 9",
                ("Celsius", "Fahrenheit"): "multiply by 9 / 5, then add 32"}
#: spelling -> (what it measures, the unit's name)
_UNIT_OF = {spelled: (kind, unit) for kind, units in _UNITS.items() for unit, spellings in units.items()
            for spelled in spellings.split()}
_SPELLINGS = "|".join(sorted(map(re.escape, _UNIT_OF), key=len, reverse=True))
#: The unit written right after a number ("7.2 metres", "59 F", "15 degrees Celsius").
_UNIT_AFTER = re.compile(rf"\s?(?:degrees?\s)?({_SPELLINGS})(?![\w°])", re.IGNORECASE)
#: The unit a task asks its answer in ("in centimetres", "how many minutes"); words only, no "m" or "F".
_ASKED_UNIT = re.compile(rf"\b(?:in|into|to|how many(?: more)?)\s+(?:degrees\s)?({_SPELLINGS})\b", re.IGNORECASE)
_WORD = re.compile(r"[\w'.-]*\w")
#: Words a goal and a memory share without being about the same thing.
_COMMON_WORDS = frozenset("what which that this have does with from they them their there many much will would "
                          "should could into about your mine memories memory file files says said tells where "
                          "read".split())
_HOW_MANY = re.compile(r"\bhow many\b", re.IGNORECASE)
#: A goal's figure written as a word ("twice a week": the 1.5B added the plants' amounts and stopped).
_TIMES = {"twice": 2, "double": 2, "thrice": 3, "triple": 3}
_TIMES_WORD = re.compile(rf"\b(?:{'|'.join(_TIMES)})\b", re.IGNORECASE)
#: A reply that writes code (a fenced block), and a goal that asks for code.
_CODE_BLOCK = re.compile(r"```")
_ASKS_FOR_CODE = re.compile(r"\b(?:code|script|program|python|function|snippet)\b", re.IGNORECASE)
#: A count written as a word ("four people said yes").
_COUNT_WORD = re.compile(r"\b(?:none|one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|thirteen|"
                         r"fourteen|fifteen|sixteen|seventeen|eighteen|nineteen|twenty|dozen)\b", re.IGNORECASE)
#: Words by which a task asks for a figure computed from what the tools find, not one they hold.
_COMPUTE = re.compile(r"\b(?:compute|calculate|add(?:ed)? up|total|sum|altogether|convert|how many more|left|cost)\b",
                      re.IGNORECASE)


def _quantities(text: str) -> list[tuple[str, float, tuple[str, str] | None]]:
    """Each number in ``text``: as written (for its decimals), its value, and the unit written after it (what
    it measures, which unit) or None."""
    out = []
    for number in _NUMBER.finditer(text):
        written = number.group().replace(",", "")
        try:
            value = float(written)
        except ValueError:  # "1,,2": not a number after all
            continue
        unit = _UNIT_AFTER.match(text, number.end())
        out.append((written, value, _unit(unit.group(1)) if unit else None))
    return out


def _values(text: str) -> list[tuple[str, float]]:
    """Each number in ``text``: as written and its value."""
    return [(written, value) for written, value, _ in _quantities(text)]


def _content_words(text: str) -> set[str]:
    """The words of ``text`` that say what it is about: longer than three letters, not common, no file paths,
    a possessive's "'s" dropped (a memory or a result line "about" the same thing as a goal shares one)."""
    words = (w.removesuffix("'s") for w in _WORD.findall(PATH.sub(" ", text).lower()))
    return {w for w in words if len(w) > 3} - _COMMON_WORDS


def _lines(result: str) -> list[str]:
    """The non-empty lines of a tool result, stripped."""
    return [line.strip() for line in result.splitlines() if line.strip()]


def _expression(arguments: str) -> str:
    """The text of a call's arguments (a calculator's expression), whatever the parameter is called."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return " ".join(str(v) for v in value.values()) if isinstance(value, dict) else str(value)


def _unit(spelled: str) -> tuple[str, str] | None:
    return _UNIT_OF.get(spelled.lower())


def conversion(source: str, target: str) -> str:
    """How to convert a figure from one unit to another of the same kind, in words: "hours to minutes: multiply
    by 60" (the 1.5B, told to convert 2 hours and 40 minutes, computed 2 * 40)."""
    if (source, target) in _TEMPERATURE:
        how = _TEMPERATURE[source, target]
    else:
        ratio = _SIZE[source] / _SIZE[target]
        how = f"multiply by {ratio:.6g}" if ratio >= 1 else f"divide by {1 / ratio:.6g}"
    return f"{source} to {target}: {how}"


@dataclass
class WorkingMemory:
    """What one run knows: the goal, recalled memories, and each tool call with its result, oldest first.

    ``compute_tool``: the tool that calculates (the built-in ``calculator``), when the run has one; an answer
    that the goal asks to be computed, but that only repeats what the other tools found, is not done yet.
    """

    goal: str
    memories: Sequence[str] = ()
    facts: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, arguments as JSON, result)
    compute_tool: str | None = None

    def add(self, tool: str, arguments: str, result: str) -> None:
        self.facts.append((tool, arguments, result))

    def unread(self, *texts: str) -> list[str]:
        """Files ``texts`` name (default: the goal and every result) that no call has been given yet."""
        asked = set(PATH.findall(" ".join(arguments for _, arguments, _ in self.facts)))  # whole names only
        named = PATH.findall(" ".join(texts or [self.goal, *(result for _, _, result in self.facts)]))
        return [path for path in dict.fromkeys(named) if path not in asked]

    def still_to_read(self, answer: str) -> list[str]:
        """The unread files ``answer`` cannot do without: those the goal or the answer names, and those a result
        names on a line about the goal ("Babysitter: details in people/babysitter.txt" for "contacts.txt tells
        where the babysitter's details are"; not the other files an index lists)."""
        goal = _content_words(self.goal)
        pointers = [line for _, _, r in self.facts for line in _lines(r) if goal & _content_words(line)]
        return self.unread(self.goal, answer, *pointers)

    def invented(self, answer: str) -> list[str]:
        """Numbers in ``answer`` that the goal, the memories, the tool results and the conversions do not hold, even
        rounded up or down to the digits written, as a measure of the same kind where both name a unit (only once
        a tool ran or the goal has numbers: "a spider has 8 legs" needs no source)."""
        known = [(v, unit) for text in (self.goal, *self.memories, *(r for _, _, r in self.facts), *self.conversions())
                 for _, v, unit in _quantities(text)]
        if not self.facts and not _values(self.goal):
            return []
        # A count of what a result lists is computed from it (the goal asks "how many" things a file holds).
        most = max((len(_lines(r)) for _, _, r in self.facts), default=0) if _HOW_MANY.search(self.goal) else 0

        def grounded(written: str, value: float, unit: tuple[str, str] | None) -> bool:
            digit = 10.0 ** -len(written.partition(".")[2])  # within one unit of its last digit: 8029 for 8029.7
            return (value.is_integer() and 0 < value <= most) or any(
                (abs(v - value) < digit or math.isclose(v, value, abs_tol=1e-9))
                and (unit is None or source is None or unit[0] == source[0])  # 500 ml does not back 500 g
                for v, source in known)
        return list(dict.fromkeys(w for w, v, unit in _quantities(answer) if not grounded(w, v, unit)))

    def asked_unit(self) -> tuple[str, str] | None:
        """What the goal asks its answer in, and the unit (the last one it names: "settings in Fahrenheit.
        What is the night setting in Celsius?" asks in Celsius)."""
        asked = _ASKED_UNIT.findall(self.goal)
        return _unit(asked[-1]) if asked else None

    def conversions(self) -> list[str]:
        """How to convert each unit the goal, the related memories and the results measure in to the unit the
        goal asks for (same kind, another unit)."""
        if not (want := self.asked_unit()):
            return []
        texts = (self.goal, *self.related_memories(), *(r for _, _, r in self.facts))
        units = dict.fromkeys(u for text in texts for _, _, u in _quantities(text) if u and u[0] == want[0])
        return [conversion(unit, want[1]) for _, unit in units if unit != want[1]]

    def wrong_units(self, answer: str) -> list[str]:
        """Units in ``answer`` that measure what the goal asks for in another unit ("7.2 metres" when it asks
        in centimetres; "2 hours and 40 minutes" when it asks how many minutes)."""
        if not (want := self.asked_unit()):
            return []
        given = [unit for _, _, unit in _quantities(answer) if unit]
        return list(dict.fromkeys(unit for kind, unit in given if kind == want[0] and unit != want[1]))

    def restated(self, answer: str) -> bool:
        """``answer`` only repeats figures the goal, the memories or the tools gave, while the goal asks for one
        computed from them and the run's calculating tool has not been called."""
        if not self.compute_tool or not _COMPUTE.search(self.goal) or \
                any(tool == self.compute_tool for tool, _, _ in self.facts):
            return False
        found = self._found()
        numbers = [v for _, v in _values(answer)]
        return bool(numbers) and all(v in found for v in numbers)

    def omits_result(self, answer: str) -> str | None:
        """The computing tool's last result, when the goal asks for a computed figure and ``answer`` gives only
        figures the goal, memories or other tools gave (the 1.5B computed 1840 * 12, then answered "The monthly
        rent is 1840 euros.")."""
        results = [r for tool, _, r in self.facts if tool == self.compute_tool]
        if not results or not _COMPUTE.search(self.goal) or not (numbers := [v for _, v in _values(answer)]):
            return None
        computed, found = {v for r in results for _, v in _values(r)}, self._found()
        return results[-1].strip() if all(v in found and v not in computed for v in numbers) else None

    def _found(self) -> set[float]:
        """The values of the figures the goal, the memories and the tools other than the computing one gave."""
        texts = (self.goal, *self.memories, *(r for tool, _, r in self.facts if tool != self.compute_tool))
        return {v for text in texts for _, v in _values(text)}

    def iterates(self, tool: str, arguments: str) -> bool:
        """A call of the computing tool that applies its last calculation again to that one's result (23 * 2.2
        gave 50.6, then 50.6 * 2.2): small models go on so once they have the answer."""
        last = next(((a, r) for t, a, r in reversed(self.facts) if t == tool), None)
        if tool != self.compute_tool or last is None or not (result := _values(last[1])):
            return False
        before, now = _expression(last[0]), _expression(arguments)
        if _NUMBER.sub("N", before).replace(" ", "") != _NUMBER.sub("N", now).replace(" ", ""):
            return False
        operands = [v for _, v in _values(now)]
        if result[0][1] not in operands:
            return False
        operands.remove(result[0][1])
        return set(operands) <= {v for _, v in _values(before)}

    def echoes_goal(self, answer: str) -> bool:
        """``answer`` is words of the goal only ("The dishwasher's manual is listed in manuals.txt." for a goal
        that says so, then asks which program it recommends): it restates the task, not what answers it."""
        words = _WORD.findall(answer.lower())
        return len(words) >= 3 and set(words) <= set(_WORD.findall(self.goal.lower()))

    def counting(self) -> bool:
        """The goal asks how many things (not how many of a unit), and a result lists several lines: the answer
        is a count of them, which the calculator cannot make (the 1.5B wrote ``count(packing.txt)`` for it)."""
        return bool(_HOW_MANY.search(self.goal)) and not self.asked_unit() and \
            any(len(_lines(r)) > 1 for _, _, r in self.facts)

    def unused_figures(self) -> list[str]:
        """Figures of the goal that no calculation used, once the computing tool has run ("for 4 people ... for
        10": the 1.5B computed 250 * 10)."""
        expressions = [_expression(a) for tool, a, _ in self.facts if tool == self.compute_tool]
        if not expressions:
            return []
        used = {v for e in expressions for _, v in _values(e)}
        figures = _values(self.goal) + [(m.group(), _TIMES[m.group().lower()]) for m in _TIMES_WORD.finditer(self.goal)]
        return list(dict.fromkeys(w for w, v in figures if v not in used))

    def needs_computing(self, answer: str) -> bool:
        """The computing tool should take the next step: ``answer`` is in the wrong unit, only restates, or comes
        from a calculation that left out a figure of the goal."""
        return bool(self.compute_tool) and (bool(self.wrong_units(answer)) or self.restated(answer)
                                            or bool(self.unused_figures()))

    def unmet(self, answer: str) -> list[str]:
        """Why ``answer`` does not finish the task yet; empty when it may stand (files: ``still_to_read``)."""
        reasons = [f"{path} has not been read yet" for path in self.still_to_read(answer)]
        if invented := self.invented(answer):
            was = "was" if len(invented) == 1 else "were"
            reasons.append(f"{', '.join(invented)} {was} not read or counted; count the numbered lines found"
                           if self.counting() else f"{', '.join(invented)} {was} not read or computed with a tool; "
                           "compute with a tool")
        if _HOW_MANY.search(self.goal) and not _values(answer) and not _COUNT_WORD.search(answer):
            reasons.append("it does not say how many")
        if wrong := self.wrong_units(answer):
            want = self.asked_unit()[1]
            reasons.append(f"the task asks for {want}, not {', '.join(wrong)}; convert with a tool ("
                           + "; ".join(conversion(unit, want) for unit in wrong) + ")")
        if _CODE_BLOCK.search(answer) and not _ASKS_FOR_CODE.search(self.goal):  # the 1.5B's plan for a count
            reasons.append("it writes code instead of answering; the tools do not run it")
        if self.echoes_goal(answer):
            reasons.append("it repeats the task instead of answering it")
        if unused := self.unused_figures():
            reasons.append(f"the task's {', '.join(unused)} {'is' if len(unused) == 1 else 'are'} in no calculation "
                           "yet")
        if (result := self.omits_result(answer)) is not None:
            reasons.append(f"it gives what was found, not what {self.compute_tool} computed from it ({result})")
        if self.restated(answer):
            reasons.append(f"it only repeats what was found, and the task asks for a result computed from it; "
                           f"compute it with {self.compute_tool}")
        return reasons

    def related_memories(self) -> list[str]:
        """The recalled memories that share a word with the goal: restated in the note, since the 1.5B asked
        again for a price it had been given, and answered from an unrelated memory when all were restated."""
        goal = _content_words(self.goal)
        return [m for m in self.memories if goal & _content_words(m)]

    def note(self) -> str:
        """The working memory as prompt text: the task, the recalled memories, what the tools gave so far, and
        what is still missing."""
        lines = [f"Task: {self.goal}"]
        if related := self.related_memories():  # recalled into the first prompt, far above by now
            lines += ["Remembered:", *(f"- {memory}" for memory in related)]
        if self.facts:
            lines.append("Found so far:")
            counting = self.counting()
            for tool, arguments, result in self.facts:
                listed = _lines(result)
                if counting and len(listed) > 1:  # numbered, so the count is read off the last line
                    listed = [f"{i}. {line}" for i, line in enumerate(listed, 1)]
                flat = " / ".join(listed)
                lines.append(f"- {tool} {arguments} -> {flat[:FACT_CHARS]}{'...' if len(flat) > FACT_CHARS else ''}")
        if self.counting():  # the 1.5B otherwise writes Python for the calculator: sum(1 for line in ...)
            lines.append("Count with the numbered lines above; the calculator cannot count.")
        if unread := self.still_to_read(""):  # not every file an index lists: the 1.5B answered with one of those
            lines.append(f"Not read yet: {', '.join(unread)}.")
        return "\n".join(lines)
