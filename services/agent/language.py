"""The language a text is written in, named in English for the prompts ("Answer in German.").

A statistical identifier (py3langid: character n-grams over about 140 languages) rather than the model: a small
model names English for a German question that holds a file path or a technical word, and costs a call; the
identifier takes well under a millisecond and reads no word list of ours. Where it is unsure (a formula, a name,
a word or two) it says nothing, and the caller decides.
"""

from __future__ import annotations

from functools import cache

#: py3langid's normalized probability (over every language it knows) from which a task's language counts as
#: known: on the tune and false-positive sets' 106 tasks, every task above it was named right, and the two it
#: named wrong (a formula and a five-word question) scored 0.02 and 0.11. Close languages share the mass: a
#: plain Spanish sentence can score 0.7.
TASK = 0.5
#: The probability from which an answer counts as surely in a language: sending a right answer back costs a step.
ANSWER = 0.8


@cache
def _identifier():
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)


@cache
def _english_names() -> dict[str, str]:
    from babel import Locale

    return dict(Locale("en").languages)


def identify(text: str, confident: float) -> str | None:
    """The English name of ``text``'s language ("German"), or None where the identifier's probability is under
    ``confident`` or the language has no English name."""
    code, probability = _identifier().classify(text)
    if probability < confident:
        return None
    return _english_names().get(code)
