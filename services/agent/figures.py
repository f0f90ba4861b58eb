"""Figures an answer gives that nothing the run knows backs: read in every way a language writes numbers.

The default check of a candidate answer's numbers, for a task in any language: a number is backed when some
reading of it (``1,500`` is 1.5 where a comma is the decimal mark, 1500 where it groups thousands) matches some
reading of a number in the task, the recalled memories or a tool's result, to the digits written, or counts at
most the lines a result lists (a count of what was read). Digits are the same in every language; which mark
is the decimal one is not, so both are tried rather than guessed from the user's words.
"""

from __future__ import annotations

import math
import re
from typing import Iterable

from shared.arithmetic import evaluate

#: A number as written, with "," or "." grouping or marking decimals (``1,840``, ``8,40``, ``1.234,5``, ``-3``);
#: not the digits inside a word or a path (``v1.2``, ``notes2.txt``). A comma after a word ends a CSV cell:
#: ``tins,6,cellar`` holds 6.
WRITTEN = re.compile(r"(?<![\w.])(?<!\d,)-?\d+(?:[.,]\d+)*(?![\w])")


def readings(written: str) -> set[tuple[float, int]]:
    """Each value ``written`` may stand for, with its decimals (for rounding): "1,500" -> {(1.5, 3), (1500, 0)};
    "8,40" -> {(8.4, 2)} (a group of thousands has three digits)."""
    out = set()
    for decimal, group in ((".", ","), (",", ".")):
        whole, _, fraction = written.rpartition(decimal) if decimal in written else (written, "", "")
        if not whole:
            whole, fraction = fraction, ""
        if decimal in whole:  # two decimal marks: not this convention
            continue
        digits = whole.replace(group, "")
        if group in whole and not all(len(part) == 3 for part in whole.split(group)[1:]):
            continue  # "1,23,4" groups no thousands
        try:
            out.add((float(f"{digits}.{fraction}" if fraction else digits), len(fraction)))
        except ValueError:
            continue
    return out


def values(text: str) -> set[float]:
    """Every reading of every number in ``text``, and of each comma-separated part of one (the cells of a CSV
    row: ``12,42,51``)."""
    written = [match.group() for match in WRITTEN.finditer(text)]
    cells = [cell for number in written if "," in number for cell in number.split(",")]
    return {value for number in [*written, *cells] for value, _ in readings(number)}


def unbacked(answer: str, sources: Iterable[str], listed: int = 0) -> list[str]:
    """Numbers in ``answer`` (as written) that no reading backs: not in ``sources`` (even rounded to the digits
    written) and not a count of at most ``listed`` lines."""
    known = set().union(*(values(text) for text in sources))
    out = []
    for match in WRITTEN.finditer(answer):
        written = match.group()
        if not any(_backed(value, decimals, known, listed) for value, decimals in readings(written)):
            out.append(written)
    return list(dict.fromkeys(out))


def _backed(value: float, decimals: int, known: set[float], listed: int) -> bool:
    if value.is_integer() and 0 < value <= listed:
        return True
    step = 10.0 ** -decimals  # within one unit of its last digit: 8029 for 8029.7
    return any(abs(v - value) < step or math.isclose(v, value, abs_tol=1e-9) for v in known)


def gives(answer: str, value: float) -> bool:
    """Whether some reading of a number in ``answer`` is ``value``, rounded to the digits written (or the value
    rounded to the answer's digits: 8029 for 8029.73)."""
    return any(_backed(reading, decimals, {value}, 0)
               for match in WRITTEN.finditer(answer) for reading, decimals in readings(match.group()))


#: Math notation as a model writes it in prose or LaTeX, made Python's: the same in every language.
_NOTATION = [(re.compile(r"\\text\{([^{}]*)\}"), r" \1 "), (re.compile(r"\\frac\{([^{}]*)\}\{([^{}]*)\}"), r"(\1)/(\2)"),
             (re.compile(r"\\times|\\cdot|[×·]"), "*"), (re.compile(r"\\div|÷"), "/"), (re.compile(r"[−–]"), "-"),
             (re.compile(r"(?<=\d)\s*x\s*(?=\d)"), " * "), (re.compile(r"\^"), "**"),
             (re.compile(r"\\[\[\]()]|\$"), " ")]
#: Where the arithmetic before an "=" starts: a line, a clause (":", ";", another "="), or a sentence or list
#: mark followed by a space (a decimal mark never is).
_STEP_START = re.compile(r"[\n:;=?!]|[.,](?=\s)")
#: Characters before an "=" beyond which it is prose, not a step of arithmetic.
_LONGEST_STEP = 200
#: A slash between letters is a unit's ("euros/week", "km/h"), not a division.
_UNIT_SLASH = re.compile(r"(?<=[^\W\d_])/(?=[^\W\d_])")
#: Two figures with nothing but space between them (the words between them dropped): separate runs.
_SEPARATE_FIGURES = re.compile(r"(?<=[\d)]) (?=[\d(])")
#: An ordered list's marker at a line's start ("2. Divide ..."): a position, not a figure.
_LIST_MARKER = re.compile(r"(?m)^(\s*)\d{1,2}[.)](?=\s)")


def without_list_markers(answer: str) -> str:
    return _LIST_MARKER.sub(r"\1", answer)


def shown_steps(answer: str) -> list[tuple[str, float]]:
    """The arithmetic ``answer`` shows and gets right: each "expression = figure" (units and words between the
    numbers dropped: "150 euros - 42 euros = 108 euros") whose expression, read with either decimal mark, is the
    figure to its digits. As (expression, value), in the order written, so a later step may use an earlier one's."""
    text = answer
    for pattern, replacement in _NOTATION:
        text = pattern.sub(replacement, text)
    steps, start = [], 0
    for equals in re.finditer("=", text):
        for boundary in _STEP_START.finditer(text, start, equals.start()):
            start = boundary.end()
        left, start = text[start:equals.start()], equals.end()
        if len(left) > _LONGEST_STEP:
            continue
        left = _UNIT_SLASH.sub(" ", left)
        left = re.sub(r"[^0-9.,+\-*/() ]", " ", left)
        left = re.sub(r"\s+", " ", left).strip(" .,")
        left = _SEPARATE_FIGURES.split(left)[-1]  # "5 and 1,500 * 2": the arithmetic is the last run
        result = WRITTEN.search(text, equals.end(), equals.end() + 12)
        if result is None or not re.search(r"[\d)]\s*[-+*/]", left):
            continue
        for expression in _decimal_readings(left):
            try:
                value = evaluate(expression)
            except (SyntaxError, ValueError, ArithmeticError, TypeError):
                continue
            if isinstance(value, (int, float)) and _states(result.group(), float(value)):
                steps.append((expression, float(value)))
                break
    return steps


def _decimal_readings(expression: str) -> list[str]:
    """``expression`` with its marks read both ways: "," grouping thousands or marking decimals."""
    return list(dict.fromkeys([expression.replace(",", ""), expression.replace(".", "").replace(",", ".")]))


def _states(written: str, value: float) -> bool:
    """Whether ``written`` is ``value`` to its digits, rounded or cut off (8030 or 8029 for 8029.7; 3 is not
    12 / 5)."""
    for reading, decimals in readings(written):
        scale = 10 ** decimals
        if any(math.isclose(reading, shown, abs_tol=0.1 / scale)
               for shown in (round(value, decimals), math.trunc(value * scale) / scale)):
            return True
    return False
