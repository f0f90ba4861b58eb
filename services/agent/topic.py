"""Which lines of what a run read are about its task: the words they share with it, in any language.

A result that points elsewhere ("Plumber: details in people/plumber.txt") is followed where its line is
about what the task asks. Words are compared by their letters alone: two words are the same where one begins
the other and the shorter has at least four letters (an inflection's ending: "Kühlschranks" and
"Kühlschrank"), so no language's word list is needed; a word every one of several lines holds ("boîte" of
"Boîte rouge" and "Boîte bleue") tells none of them apart and is not counted. File paths are not words here:
a path is named alike in the task and in the line that points to it without saying what the file is about.
"""

from __future__ import annotations

import re

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
    wanted = words(goal)
    held = [words(candidate) for candidate in candidates]
    common = set.intersection(*held) if len(held) > 1 else set()
    shared = [sum(any(_same(word, w) for w in wanted) for word in these - common) for these in held]
    most = max(shared, default=0)
    return [candidate for candidate, count in zip(candidates, shared) if most and count == most]
