"""Tool calls in the model's own format: the tools' table, the grammars that constrain a call, and the parser.

Qwen 2.5 (like Hermes, Qwen 3 and most templates that render tools) writes a call as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; it is also the
format Magnitude teaches models whose template has no tool support. Small models
often write the same JSON bare, or in a ```json fence, instead of the tags, and
sometimes with its braces doubled (``{{"name": ...}}}``, the escaping of Python
format strings); llama-server drops those as text. The parser takes them all, the
bare and fenced forms only when they name a real tool.

The grammar side is lazy: free text stays free, and a call is constrained (its name
one of the tools', its arguments valid under that tool's JSON schema) from the moment
the model opens it: the ``<tool_call>`` tag anywhere, or a bare/fenced JSON object
that starts with ``"name"`` at the very beginning of the reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

from services.inference.constraint import Trigger, Vocabulary, check_schema, compile_lark, json_lark
from services.inference.patterns import linear_validator
from shared import protocol
from shared.protocol import MAX_TOOLS_BYTES, bad_request

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FENCE = re.compile(r"```([^`\n]*)\n")
_DECODER = json.JSONDecoder()
#: A bare or fenced call at the start of the reply (its braces maybe doubled), recognised once "name" is written.
_BARE_OPENER = re.compile(rb'\A\s*(?:```(?:json)?[ \t]*\n\s*)?\{\{?"name"')



@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict
    validator: Any  # a jsonschema validator of the parameters


def tool_table(tools: list[protocol.Tool]) -> dict[str, Tool]:
    """The request's ``tools`` (their shape checked as the body was decoded), checked as schemas (bounded, valid,
    not too big together) with no two of one name."""
    table: dict[str, Tool] = {}
    total = 0
    for i, tool in enumerate(tools):
        fn = tool.function
        checked = checked_tool(fn.name, fn.parameters, f"tools[{i}].function.parameters")
        total += len(json.dumps(checked.parameters))
        if total > MAX_TOOLS_BYTES:
            raise bad_request(f"the tools' schemas are over {MAX_TOOLS_BYTES // 1024} KiB together")
        if fn.name in table:
            raise bad_request(f"tools[{i}]: two tools are named {fn.name!r}")
        table[fn.name] = checked
    return table


def checked_tool(name: str, parameters: dict | None, where: str) -> Tool:
    """A tool whose ``parameters`` are a bounded, valid JSON schema (None: no parameters); ``where`` names them
    in the error."""
    params = {"type": "object", "properties": {}} if parameters is None else parameters
    check_schema(params, where)
    try:
        validator = linear_validator(params)
    except jsonschema.SchemaError as err:
        raise bad_request(f"{where} is not a valid JSON schema: {err.message[:200]}") from None
    return Tool(name, params, validator)


# --- grammars -----------------------------------------------------------------------------
def _call_schema(tools: dict[str, Tool]) -> dict:
    return {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                       "required": ["name", "arguments"], "additionalProperties": False}
                      for t in tools.values()]}


def _tag(text: str, vocab: Vocabulary) -> str:
    """A tag as a Lark terminal: the special token when the vocabulary has one (Qwen), else its text."""
    return text if vocab.single_special(text) is not None else json.dumps(text)


def calls_lark(tools: dict[str, Tool], vocab: Vocabulary, single: bool = False) -> str:
    """Lark rules (start rule ``calls``) for one or more tagged calls."""
    more = "" if single else ' ("\\n" call_block)*'
    return (f"calls: call_block{more}\n"
            f'call_block: {_tag(OPEN, vocab)} "\\n" call "\\n" {_tag(CLOSE, vocab)}\n'
            f"call: {json_lark(_call_schema(tools))}\n")


def tagged_grammar(tools: dict[str, Tool], vocab: Vocabulary, single: bool = False) -> str:
    return compile_lark("start: calls\n" + calls_lark(tools, vocab, single), vocab)


def triggers(tools: dict[str, Tool], vocab: Vocabulary) -> list[Trigger]:
    """Lazy grammars for ``tool_choice: auto``: the tagged form anywhere, the bare or fenced form at the start."""
    bare = compile_lark('start: WS? ("```" "json"? "\\n" call "\\n" "```" | call | "{" call "}")\n'
                        "WS: /[ \\t\\r\\n]+/\n"
                        f"call: {json_lark(_call_schema(tools))}\n", vocab)
    return [Trigger(re.compile(re.escape(OPEN.encode())), tagged_grammar(tools, vocab)),
            Trigger(_BARE_OPENER, bare)]


def answer_or_calls_grammar(schema: dict, tools: dict[str, Tool] | None, vocab: Vocabulary) -> str:
    """``response_format``: JSON under ``schema`` from the first token, or (with tools) tagged calls instead."""
    if not tools:
        return compile_lark(f"start: {json_lark(schema)}\n", vocab)
    return compile_lark(f"start: answer | calls\nanswer: {json_lark(schema)}\n" + calls_lark(tools, vocab), vocab)


# --- parsing ------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """A call read from the model's text, before it has an id (``wire`` gives it one, as the protocol's ToolCall)."""

    name: str
    arguments: str  # JSON text (the model's own text when it does not parse)
    error: str | None = None  # why the call cannot be run as written (the agent feeds it back)

    def wire(self, call_id: str) -> protocol.ToolCall:
        return protocol.ToolCall(id=call_id, type="function", function=protocol.CalledFunction(name=self.name, arguments=self.arguments),
                                 error=self.error or None)


@dataclass
class Scan:
    content: str  # assistant text that is not call markup
    calls: list[ParsedCall]


def _decode(text: str, start: int) -> tuple[Any, int | None]:
    """The JSON value at ``start`` and where it ends; an object in doubled braces (``{{...}}}`` or ``{{...}}``,
    as small models copy the escaping of format strings) is read as the object inside."""
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        pass
    if text.startswith("{{", start):
        try:
            value, end = _DECODER.raw_decode(text, start + 1)
        except json.JSONDecodeError:
            return None, None
        return value, end + (text.startswith("}", end))
    return None, None


def _validated(name: str, arguments: Any, tools: dict[str, Tool]) -> ParsedCall:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's wire does
        parsed, end = _decode(arguments.strip(), 0)
        arguments = parsed if end is not None else arguments
    text = json.dumps(arguments, ensure_ascii=False)
    tool = tools.get(name)
    if tool is None:
        return ParsedCall(name, text, f"unknown tool {name!r}; tools: {', '.join(tools)}")
    if not isinstance(arguments, dict):
        return ParsedCall(name, text, f"{name}: arguments must be a JSON object")
    error = jsonschema.exceptions.best_match(tool.validator.iter_errors(arguments))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "arguments"
        return ParsedCall(name, text, f"{name} {where}: {error.message[:300]}")
    return ParsedCall(name, text)


def _as_calls(value: Any, tools: dict[str, Tool], known_only: bool) -> list[ParsedCall]:
    """The calls a parsed JSON value holds: ``{"name", "arguments"|"parameters"}`` or a list of those."""
    items = value if isinstance(value, list) and value else [value]
    shaped = [v for v in items if isinstance(v, dict) and isinstance(v.get("name"), str)
              and ("arguments" in v or "parameters" in v)]
    if len(shaped) != len(items) or (known_only and any(v["name"] not in tools for v in shaped)):
        return []
    return [_validated(v["name"], v.get("arguments", v.get("parameters")), tools) for v in shaped]


def _tagged(body: str, tools: dict[str, Tool]) -> list[ParsedCall]:
    value, end = _decode(body.strip(), 0)
    calls = _as_calls(value, tools, known_only=False) if end is not None else []
    return calls or [ParsedCall("", json.dumps(body.strip(), ensure_ascii=False),
                              'a <tool_call> must hold {"name": ..., "arguments": {...}}')]


def _held_suffix(text: str) -> int:
    """Length of a trailing piece that may grow into markup: part of the opener, or an unfinished fence line."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    fence = text.rfind("```")
    if fence >= 0 and "\n" not in text[fence:]:
        return len(text) - fence
    return len(text) - len(text.rstrip("`"))


def scan(text: str, tools: dict[str, Tool], final: bool) -> Scan:
    """Split a reply into content and calls. While generating (``final`` False) the content stops where markup
    may be starting, and only complete calls are listed: what can be streamed now without taking it back."""
    calls: list[ParsedCall] = []
    first: int | None = None  # where the first call (or markup not yet decided) starts: content ends there
    pos = 0
    lead = len(text) - len(text.lstrip())
    if text[lead:lead + 1] in ("{", "["):
        value, end = _decode(text, lead)
        if end is None and not final:
            return Scan("", [])  # a bare call may be forming
        if end is not None and (found := _as_calls(value, tools, known_only=True)):
            calls, first, pos = found, lead, end
    while True:
        opener, fence = text.find(OPEN, pos), _FENCE.search(text, pos)
        if opener < 0 and fence is None:
            break
        if opener >= 0 and (fence is None or opener < fence.start()):
            first = opener if first is None else first
            close = text.find(CLOSE, opener)
            if close < 0:
                calls += _tagged(text[opener + len(OPEN):], tools) if final else []
                break
            calls += _tagged(text[opener + len(OPEN):close], tools)
            pos = close + len(CLOSE)
            continue
        close = text.find("```", fence.end())
        if fence.group(1).strip() not in ("", "json"):  # a code block: not a call
            if close < 0:
                break
            pos = close + 3
            continue
        body = text[fence.end():close if close >= 0 else len(text)]
        if close < 0 and not final:
            first = fence.start() if first is None else first
            break
        value, end = _decode(body.strip(), 0)
        found = _as_calls(value, tools, known_only=True) if end is not None else []
        if found:
            first = fence.start() if first is None else first
            calls += found
        if close < 0:
            break
        pos = close + 3
    content_end = first if first is not None else len(text) - (0 if final else _held_suffix(text))
    content = text[:content_end]
    if calls or not final:  # whitespace before a call is not content (and may precede one, while streaming)
        content = content.rstrip()
    return Scan(content, calls)
