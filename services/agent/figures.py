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
