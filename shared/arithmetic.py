"""Arithmetic without ``eval``: an expression parsed to an AST, and only whitelisted nodes walked.

The tool service's ``calculator`` and the agent's step policy (which checks an answer against the expression
the model writes for it, and evaluates a calculator call over a table the run has read) evaluate with it.
Besides numbers it knows lists of numbers (``[42, 36, 45]``, or a name bound to a table's column) for ``sum``,
``len``, ``mean``, ``min`` and ``max``, and clock times (``09:15 + 85`` is ``10:40``; ``18:10 - 09:15`` is 535
minutes), written the same way in every language the agent serves.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Union

_MAX_EXPONENT = 1000
_MAX_INT_BITS = 4096
_MAX_LIST = 10_000
_DAY_MINUTES = 24 * 60
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.BitXor: operator.pow,  # models write 2^10 for a power; nobody asks a calculator for xor
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_CONSTANTS = {"pi": math.pi, "e": math.e}
#: A clock time as written: ``9:15``, ``16:30`` (not a ratio's ``3:1``, not inside ``12:30:00``).
_CLOCK = re.compile(r"(?<![\w:.])(\d{1,2}):([0-5]\d)(?![\w:])")
_CLOCK_CALL = "clock_time_"  # what a written clock time becomes before parsing

Number = Union[int, float]
#: What a name may stand for: a number, or a list of them (a table's column).
Value = Union[Number, list[Number]]


@dataclass(frozen=True)
class ClockTime:
    """A time of day: plus or minus minutes it is another (past midnight too); one minus another is the minutes
    from the second to the first (over midnight: 06:30 - 22:00 is 510)."""

    minutes: int

    def __add__(self, other: Any) -> "ClockTime":
        if not isinstance(other, (int, float)):
            raise TypeError("only minutes can be added to a clock time")
        return ClockTime(round(self.minutes + other) % _DAY_MINUTES)

    __radd__ = __add__

    def __sub__(self, other: Any) -> "ClockTime | int":
        if isinstance(other, ClockTime):
            return (self.minutes - other.minutes) % _DAY_MINUTES
        return self + -other

    def __str__(self) -> str:
        return f"{self.minutes // 60:02d}:{self.minutes % 60:02d}"


def _numbers(args: tuple[Any, ...]) -> list[Number]:
    """The numbers of a function's arguments, a list argument's items among them: ``sum(a)`` and ``sum(1, 2)``."""
    out: list[Number] = []
    for arg in args:
        out.extend(arg if isinstance(arg, list) else [arg])
    if not out:
        raise ValueError("no numbers to compute with")
    return out


def _length(*args: Any) -> int:
    if len(args) != 1 or not isinstance(args[0], list):
        raise ValueError("len takes one list")
    return len(args[0])


def _mean(*args: Any) -> float:
    numbers = _numbers(args)
    return sum(numbers) / len(numbers)


def _clock_time(hours: int, minutes: int) -> ClockTime:
    if not 0 <= hours <= 24:
        raise ValueError(f"{hours}:{minutes:02d} is not a clock time")
    return ClockTime(hours * 60 + minutes)


_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "log": math.log,
    "log10": math.log10, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
    "min": lambda *a: min(_numbers(a)), "max": lambda *a: max(_numbers(a)), "sum": lambda *a: sum(_numbers(a)),
    "mean": _mean, "avg": _mean, "average": _mean, "len": _length, "count": _length,
}


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise ValueError(f"result exceeds {_MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    if isinstance(value, complex):
        raise ValueError("result is complex")
    return value


def _scalar(value: Any) -> Any:
    if isinstance(value, list):
        raise ValueError("arithmetic on a list: take its sum, mean, min, max or len first")
    return value


class _Evaluator:
    def __init__(self, names: Mapping[str, Value]):
        self.names = names

    def eval(self, node: ast.AST) -> Any:  # noqa: C901 (one branch per kind of node)
        if isinstance(node, ast.Expression):
            return self.eval(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.Name) and node.id in self.names:
            value = self.names[node.id]
            return list(value) if isinstance(value, list) else value
        if isinstance(node, ast.Name) and node.id in _CONSTANTS:
            return _CONSTANTS[node.id]
        if isinstance(node, ast.Name):
            known = f"; the names known are {', '.join(sorted(self.names))}" if self.names else ""
            raise ValueError(f"unknown name {node.id!r}{known}")
        if isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) <= _MAX_LIST:
            return [_scalar(self.eval(item)) for item in node.elts]
        if isinstance(node, ast.Subscript):
            items, index = self.eval(node.value), self.eval(node.slice)
            if not isinstance(items, list) or not isinstance(index, int):
                raise ValueError("only a list can be indexed, by a whole number")
            if not -len(items) <= index < len(items):
                raise ValueError(f"index {index} is outside a list of {len(items)}")
            return items[index]
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](_scalar(self.eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = _scalar(self.eval(node.left)), _scalar(self.eval(node.right))
            if type(node.op) in (ast.Pow, ast.BitXor) and abs(right) > _MAX_EXPONENT:
                raise ValueError(f"exponent above {_MAX_EXPONENT}")
            return _bounded(_BINARY[type(node.op)](left, right))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == _CLOCK_CALL
                and len(node.args) == 2):
            return _clock_time(*(self.eval(a) for a in node.args))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords and len(node.args) <= 4):
            return _bounded(_FUNCTIONS[node.func.id](*(self.eval(a) for a in node.args)))
        raise ValueError(f"unsupported syntax ({type(node).__name__}); use numbers, lists of them, clock times "
                         f"(9:15), + - * / // % ** and {', '.join(_FUNCTIONS)}")


def evaluate(expression: str, names: Mapping[str, Value] | None = None) -> Number | ClockTime:
    """The value of ``expression``: numbers, lists of numbers, clock times, + - * / // % **, a few functions, and
    ``names`` (a number or a list each); a float that is whole comes back as an int. SyntaxError for text that is
    no expression; ValueError, ArithmeticError or TypeError for one that cannot be computed."""
    written = _CLOCK.sub(lambda m: f"{_CLOCK_CALL}({int(m[1])}, {int(m[2])})", expression.strip())
    value = _Evaluator(names or {}).eval(ast.parse(written, mode="eval"))
    if isinstance(value, list):
        raise ValueError("the expression is a list, not a number: take its sum, mean, min, max or len")
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return round(value, 10) if isinstance(value, float) else value
