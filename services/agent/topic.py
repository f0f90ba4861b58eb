"""Which lines of what a run read, and which recalled memories, are about its task: the words they share with
it, in any language.

A result that points elsewhere ("Plumber: details in people/plumber.txt") is followed where its line is
about what the task asks; a recalled memory is restated in the note where it shares a word with the task. Words are compared by their letters alone: two words are the same where one begins
the other and the shorter has at least four letters (an inflection's ending: "Kühlschranks" and
"Kühlschrank"), so no language's word list is needed; a word every one of several lines holds ("boîte" of
"Boîte rouge" and "Boîte bleue") tells none of them apart and is not counted. File paths are not words here:
a path is named alike in the task and in the line that points to it without saying what the file is about.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from services.agent.working_memory import PATH

#: A word: four or more letters, in any script (digits and "_" split words).
WORD = re.compile(r"[^\W\d_]{4,}")


def words(text: str) -> set[str]:
    """The words of ``text`` outside its file paths, case folded."""
    return {word.casefold() for word in WORD.findall(PATH.sub(" ", text))}


def _same(word: str, other: str) -> bool:
    return word.startswith(other) or other.startswith(word)


def about(goal: str, candidates: list[str]) -> list[str]:
    """The ``candidates`` that share the most words with ``goal`` (none when no candidate shares one)."""
    shared = _shared(goal, candidates)
    most = max(shared, default=0)
    return [candidate for candidate, count in zip(candidates, shared) if most and count == most]


def related(goal: str, candidates: Sequence[str]) -> list[str]:
    """The ``candidates`` that share a word with ``goal``: a task may need several of them (a tank's size and
    how full it is)."""
    return [candidate for candidate, count in zip(candidates, _shared(goal, candidates)) if count]


def _shared(goal: str, candidates: Sequence[str]) -> list[int]:
    """How many of each candidate's words ``goal`` holds, not counting the words every candidate holds."""
    wanted = words(goal)
    held = [words(candidate) for candidate in candidates]
    common = set.intersection(*held) if len(held) > 1 else set()
    return [sum(any(_same(word, w) for w in wanted) for word in these - common) for these in held]
