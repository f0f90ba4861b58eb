"""The ``Thought:`` / ``Action: {json}`` protocol: the Action's schema, its GBNF grammar, and the repair layer.

An Action is ``{"tool": NAME, "args": {...}}``; ``final_answer`` (args
``{"answer": str}``) ends the run. With grammar on, llama.cpp may only sample
tokens that keep the Action valid JSON naming a real tool with schema-valid
args. With grammar off, ``parse_action`` extracts the first JSON object after
``Action:``, parses it and validates it, and says what is wrong so the model
can retry once.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
from llama_cpp.llama_grammar import json_schema_to_gbnf

from shared.config import FINAL_ANSWER

FINAL_ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "minLength": 1, "maxLength": 300}},
    "required": ["answer"],
    "additionalProperties": False,
}
#: Every free-text field gets a bound, so a constrained Action always closes within max_tokens.
_DEFAULT_MAX_LENGTH = 200
#: Bounded integer ranges up to this size become enums: the GBNF converter ignores minimum/maximum.
_MAX_ENUM_RANGE = 1000


class ActionError(ValueError):
    """The model's Action does not parse or validate; the message is fed back to it."""


def _grammar_ready(schema: Any) -> Any:
    """A copy of ``schema`` the grammar can enforce whole.

    Strings without ``maxLength`` get one (a looping model must still stop), and
    small bounded integer ranges become enums, since the converter drops
    ``minimum``/``maximum``. Wider numeric bounds are left to the validator.
    """
    if isinstance(schema, list):
        return [_grammar_ready(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _grammar_ready(v) for k, v in schema.items()}
    if out.get("type") == "string" and "enum" not in out and "const" not in out:
        out.setdefault("maxLength", _DEFAULT_MAX_LENGTH)
    lo, hi = out.get("minimum"), out.get("maximum")
    if out.get("type") == "integer" and isinstance(lo, int) and isinstance(hi, int) and 0 <= hi - lo < _MAX_ENUM_RANGE:
        out = {k: v for k, v in out.items() if k not in ("type", "minimum", "maximum")} | {"enum": list(range(lo, hi + 1))}
    return out


def action_schema(tools: list[dict]) -> dict:
    """One JSON schema for any Action: an ``anyOf`` with one branch per tool plus ``final_answer``."""
    specs = [(t["name"], t["parameters"]) for t in tools] + [(FINAL_ANSWER, FINAL_ANSWER_SCHEMA)]
    return {"anyOf": [{"type": "object",
                       "properties": {"tool": {"const": name}, "args": _grammar_ready(params)},
                       "required": ["tool", "args"], "additionalProperties": False}
                      for name, params in specs]}


def action_grammar(tools: list[dict]) -> str:
    """GBNF (root rule ``root``) for the JSON of one Action.

    llama-cpp-python's converter lets raw control characters into strings, which
    strict JSON rejects; its ``char`` rule is narrowed so every output parses.
    """
    grammar = json_schema_to_gbnf(json.dumps(action_schema(tools)))
    narrowed = re.sub(r'^char ::= \[\^"\\\\\]', r'char ::= [^"\\\\\\x00-\\x1F]', grammar, flags=re.M)
    assert narrowed != grammar, "json_schema_to_gbnf changed its char rule; update action_grammar"
    return narrowed


def _validators(tools: list[dict]) -> dict[str, jsonschema.Draft202012Validator]:
    specs = {t["name"]: t["parameters"] for t in tools} | {FINAL_ANSWER: FINAL_ANSWER_SCHEMA}
    return {name: jsonschema.Draft202012Validator(s) for name, s in specs.items()}


class ActionParser:
    """Extract and validate Actions against the tools' schemas (built once per run)."""

    def __init__(self, tools: list[dict]):
        self.validators = _validators(tools)

    def parse(self, text: str) -> dict:
        """The Action in ``text`` (model output from ``Action:`` or from its JSON on), or ``ActionError``."""
        start = text.find("{", text.find("Action:") + 1 if "Action:" in text else 0)
        if start < 0:
            raise ActionError("no JSON object after 'Action:'")
        try:
            action, _ = json.JSONDecoder().raw_decode(text, start)
        except json.JSONDecodeError as err:
            raise ActionError(f"Action is not valid JSON: {err.msg} at character {err.pos - start}") from None
        if not isinstance(action, dict) or set(action) != {"tool", "args"}:
            raise ActionError('Action must be an object with exactly "tool" and "args"')
        validator = self.validators.get(action["tool"]) if isinstance(action["tool"], str) else None
        if validator is None:
            raise ActionError(f"unknown tool {action['tool']!r}; tools: {', '.join(self.validators)}")
        error = jsonschema.exceptions.best_match(validator.iter_errors(action["args"]))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "args"
            raise ActionError(f"{action['tool']} {where}: {error.message}")
        return action
