"""A run's working memory: its goal, the memories recalled for it, and each tool call with its result.

Restated in each step's prompt (``note``): a small model loses what a tool gave once a few steps scroll by,
and answers with an intermediate result or numbers it never read. Nothing here reads the words of a language:
file names and a calculator's expressions are written the same in every language. The checks that read
English words are ``services.agent.english_rules``; the step policy (``services.agent.policy``) decides
which apply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Sequence

#: A file path as tasks and files write them (``notes/bike.txt``, ``readings.csv``): a 2-5 letter extension.
PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.[A-Za-z][A-Za-z0-9]{1,4})(?![\w/])")
#: A number of a calculator's expression or result (``1,840``, ``-3``, ``0.35``); not the digits in a name.
NUMBER = re.compile(r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?")
#: Characters of one tool result restated in the working memory.
FACT_CHARS = 240


def numbers(text: str) -> list[tuple[str, float]]:
    """Each number of ``text`` as a calculator writes it: as written (``,`` groups thousands) and its value."""
    out = []
    for number in NUMBER.finditer(text):
        written = number.group().replace(",", "")
        try:
            out.append((written, float(written)))
        except ValueError:  # "1,,2": not a number after all
            continue
    return out


def lines(result: str) -> list[str]:
    """The non-empty lines of a tool result, stripped."""
    return [line.strip() for line in result.splitlines() if line.strip()]


def expression(arguments: str) -> str:
    """The text of a call's arguments (a calculator's expression), whatever the parameter is called."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return " ".join(str(v) for v in value.values()) if isinstance(value, dict) else str(value)


@dataclass
class WorkingMemory:
    """What one run knows: the goal, recalled memories, and each tool call with its result, oldest first.

    ``compute_tool``: the tool that calculates (the built-in ``calculator``), when the run has one.
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

    def iterates(self, tool: str, arguments: str) -> bool:
        """A call of the computing tool that applies its last calculation again to that one's result (23 * 2.2
        gave 50.6, then 50.6 * 2.2): small models go on so once they have the answer."""
        last = next(((a, r) for t, a, r in reversed(self.facts) if t == tool), None)
        if tool != self.compute_tool or last is None or not (result := numbers(last[1])):
            return False
        before, now = expression(last[0]), expression(arguments)
        if NUMBER.sub("N", before).replace(" ", "") != NUMBER.sub("N", now).replace(" ", ""):
            return False
        operands = [v for _, v in numbers(now)]
        if result[0][1] not in operands:
            return False
        operands.remove(result[0][1])
        return set(operands) <= {v for _, v in numbers(before)}

    def note(self, remembered: Sequence[str], unread: Sequence[str], numbered: bool = False,
             extra: Sequence[str] = ()) -> str:
        """The working memory as prompt text: the task, the ``remembered`` memories (recalled into the first
        prompt, far above by now), what the tools gave so far (each result's lines ``numbered``, so a count is
        read off the last), the ``unread`` files still needed, and the policy's ``extra`` lines."""
        out = [f"Task: {self.goal}"]
        if remembered:
            out += ["Remembered:", *(f"- {memory}" for memory in remembered)]
        if self.facts:
            out.append("Found so far:")
            for tool, arguments, result in self.facts:
                listed = lines(result)
                if numbered and len(listed) > 1:
                    listed = [f"{i}. {line}" for i, line in enumerate(listed, 1)]
                flat = " / ".join(listed)
                out.append(f"- {tool} {arguments} -> {flat[:FACT_CHARS]}{'...' if len(flat) > FACT_CHARS else ''}")
        out += extra
        if unread:
            out.append(f"Not read yet: {', '.join(unread)}.")
        return "\n".join(out)
