"""The agent benchmark's answer check, on its own: it shares no code with services/agent, so a change to how
the agent reads numbers can never make the grader agree with it by construction.

An expected item is a number (compared as a number: "8,40" in a German answer is 8.4, "1.500" with a
thousands dot is 1500 where the language writes it so, "four"/"vier"/"cuatro"/"quatre" are 4) or a phrase
(found as whole words, case-insensitive); ``a|b`` accepts either alternative, and every item must be there.
Apart from the figures, the answer must be in the question's language: an answer with more marker words of
another language than of its own (a German question answered in English) fails, a bare figure passes.
"""

from __future__ import annotations

import math
import re

LANGUAGES = ("en", "de", "es", "fr")

#: Number words 0-20 and the tens, per language, as a reader of that language writes small counts.
_WORDS = {
    "en": "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
          "sixteen seventeen eighteen nineteen twenty",
    "de": "null eins zwei drei vier fünf sechs sieben acht neun zehn elf zwölf dreizehn vierzehn fünfzehn "
          "sechzehn siebzehn achtzehn neunzehn zwanzig",
    "es": "cero uno dos tres cuatro cinco seis siete ocho nueve diez once doce trece catorce quince dieciséis "
          "diecisiete dieciocho diecinueve veinte",
    "fr": "zéro un deux trois quatre cinq six sept huit neuf dix onze douze treize quatorze quinze seize "
          "dix-sept dix-huit dix-neuf vingt",
}
_NUMBER_WORDS = {lang: {w: i for i, w in enumerate(words.split())} for lang, words in _WORDS.items()}
_NUMBER_WORDS["de"].update({"ein": 1, "eine": 1, "einen": 1})
_NUMBER_WORDS["es"].update({"una": 1, "un": 1})
_NUMBER_WORDS["fr"].update({"une": 1})

#: Frequent short words of one language that none of the other three writes as a word of its own ("in", "de",
#: "la", "en", "y", "un", "son", "le", "was", "will", "am", "es" are left out: two languages share them).
_MARKERS = {
    "en": "the is are and of it there you your has have with for this that which to at from be needs need",
    "de": "der die das den dem ist sind und nicht mit für von zu auf im noch wird hat haben bei aus auch ich wir "
          "ein eine einen sie",
    "es": "el los las del una está están hay con para por muy tiene lo al su sus más puedes este esta estos "
          "estas también pero",
    "fr": "les est sont et du des une avec pour il elle au aux ce cette dans pas sur vous faut à ne fait",
}
_MARKER_SETS = {lang: set(words.split()) for lang, words in _MARKERS.items()}

#: A figure with optional grouping and decimals; which mark is the decimal one is decided per language.
_FIGURE = re.compile(r"(?<![\w.,])-?\d+(?:[.,\u202f\u00a0 ]\d+)*(?![\w])")
_PLAIN_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _figure_value(text: str, language: str) -> float | None:
    """The value of one written figure: English groups with "," and decimals with "."; German, Spanish and
    French the other way round (and French groups with spaces). A lone separator followed by exactly three
    digits is read as grouping in either convention ("1,500" / "1.500"), anything else as decimals."""
    text = text.replace("\u202f", " ").replace("\u00a0", " ")
    group, decimal = (",", ".") if language == "en" else (".", ",")
    if language != "en":
        text = text.replace(" ", "")
    elif " " in text:
        return None  # two English figures side by side, not one
    if group in text and decimal in text:
        text = text.replace(group, "").replace(decimal, ".")
    elif text.count(group) == 1 and re.fullmatch(r"-?\d{1,3}" + re.escape(group) + r"\d{3}", text):
        text = text.replace(group, "")
    elif text.count(group) > 1:
        text = text.replace(group, "")
    elif decimal in text or group in text:
        text = text.replace(group, ".").replace(decimal, ".")
    try:
        return float(text)
    except ValueError:
        return None


def numbers(answer: str, language: str = "en") -> list[float]:
    """Every number the answer states, figures and number words of its language (English words always count:
    a model that answers a German question in English is judged on its figure, the language check is apart)."""
    out = [v for m in _FIGURE.findall(answer) if (v := _figure_value(m, language)) is not None]
    words = {**_NUMBER_WORDS["en"], **_NUMBER_WORDS.get(language, {})}
    for word in re.findall(r"[^\W\d_]+(?:-[^\W\d_]+)*", answer.lower()):
        if word in words:
            out.append(float(words[word]))
    return out


def holds(answer: str, item: str, language: str = "en") -> bool:
    """One expected item (no ``|``) is in the answer: a number as a number, a phrase as whole words."""
    if _PLAIN_NUMBER.fullmatch(item):
        return any(math.isclose(n, float(item), abs_tol=1e-9) for n in numbers(answer, language))
    return re.search(rf"(?<!\w){re.escape(item)}(?!\w)", answer, re.IGNORECASE) is not None


def markers(answer: str) -> dict[str, int]:
    """How many marker words of each language the answer holds."""
    words = re.findall(r"[^\W\d_]+", answer.lower())
    return {lang: sum(w in marker_set for w in words) for lang, marker_set in _MARKER_SETS.items()}


def in_language(answer: str, language: str = "en") -> bool:
    """The answer is not written in another language: no other language has more marker words in it (a bare
    figure or name, with none, passes)."""
    counts = markers(answer)
    return all(n <= counts[language] for n in counts.values())


def correct(answer: str | None, expected: tuple[str, ...], language: str = "en") -> bool:
    """The final answer is in the question's language and holds every expected item (one of its ``|``
    alternatives)."""
    return (bool(answer) and in_language(answer, language)
            and all(any(holds(answer, alt, language) for alt in item.split("|")) for item in expected))
