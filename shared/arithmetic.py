"""Arithmetic without ``eval``: an expression parsed to an AST, and only whitelisted nodes walked.

The tool service's ``calculator`` and the agent's step policy (which checks an answer against the expression
the model writes for it) evaluate with it.
"""

from __future__ import annotations

import ast
import math
import operator
from typing import Any, Callable

_MAX_EXPONENT = 1000
_MAX_INT_BITS = 4096
_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.BitXor: operator.pow,  # models write 2^10 for a power; nobody asks a calculator for xor
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "log": math.log, "log10": math.log10, "exp": math.exp, "sin": math.sin,
    "cos": math.cos, "tan": math.tan,
}
_CONSTANTS = {"pi": math.pi, "e": math.e}


def _bounded(value: Any) -> Any:
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise ValueError(f"result exceeds {_MAX_INT_BITS} bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("result is not finite")
    if isinstance(value, complex):
        raise ValueError("result is complex")
    return value


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:
        return _CONSTANTS[node.id]
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if type(node.op) in (ast.Pow, ast.BitXor) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent above {_MAX_EXPONENT}")
        return _bounded(_BINARY[type(node.op)](left, right))
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
            and not node.keywords and len(node.args) <= 4):
        return _bounded(_FUNCTIONS[node.func.id](*(_eval(a) for a in node.args)))
    raise ValueError(f"unsupported syntax ({type(node).__name__}); use numbers, + - * / // % ** "
                     f"and {', '.join(_FUNCTIONS)}")


def evaluate(expression: str) -> int | float:
    """The value of ``expression`` (numbers, + - * / // % **, a few math functions); a float that is whole comes
    back as an int. SyntaxError for text that is no expression; ValueError, ArithmeticError or TypeError for one
    that cannot be computed."""
    value = _eval(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return round(value, 10) if isinstance(value, float) else value
