"""The columns of a table a tool read, by their header's names: the facts a calculator expression may name.

A tool result that holds a table (a header row of names, then rows of as many cells: CSV, or cells separated by
semicolons, tabs or a Markdown table's bars) gives each column whose cells are all numbers under its header's
name, so the arithmetic the model writes over it (``sum(minutes) / len(minutes)``) is computed over the values
read instead of figures copied by hand. The names are the file's own words, in whatever language it is
written: nothing here reads the user's.
"""

from __future__ import annotations

import re
from itertools import takewhile

from services.agent.working_memory import lines

SEPARATORS = (",", ";", "\t", "|")
#: A header cell: a name that starts with a letter ("minutes", "area_m2", "price (EUR)", "Länge").
_HEADER_CELL = re.compile(r"[^\W\d_][\w .()%/-]{0,39}")
_RULE = re.compile(r"[\s|:+-]+")  # a Markdown table's |---|---| line
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_DECIMAL_COMMA = re.compile(r"-?\d+,\d+")


def columns(text: str) -> dict[str, list[float]]:
    """Each all-number column of each table in ``text``, by its header's name made an identifier (the first
    table that names one wins)."""
    rows = [row for row in lines(text) if not _RULE.fullmatch(row)]
    found: dict[str, list[float]] = {}
    for at, header in enumerate(rows):
        for separator in SEPARATORS:
            names = _cells(header, separator)
            if len(names) < 2 or not all(_HEADER_CELL.fullmatch(name) for name in names):
                continue
            body = list(takewhile(lambda cells: len(cells) == len(names),
                                  (_cells(row, separator) for row in rows[at + 1:])))
            for index, name in enumerate(names):
                numbers = [_number(cells[index], separator) for cells in body]
                if body and all(n is not None for n in numbers):
                    found.setdefault(_identifier(name), [n for n in numbers if n is not None])
            break
    return found


def _cells(row: str, separator: str) -> list[str]:
    if separator == "|":
        row = row.strip().strip("|")
    return [cell.strip() for cell in row.split(separator)]


def _number(cell: str, separator: str) -> float | None:
    if _NUMBER.fullmatch(cell):
        return float(cell)
    if separator != "," and _DECIMAL_COMMA.fullmatch(cell):  # "8,40" in a table whose cells a comma cannot end
        return float(cell.replace(",", "."))
    return None


def _identifier(name: str) -> str:
    """``price (EUR)`` -> ``price_EUR``: a name an expression can write."""
    return re.sub(r"\W+", "_", name).strip("_")
